// hidden [M,F] = silu(gate) * up and u [M,R] = hidden A [R,F]^T in one op that keeps only gate and up
// (the SwiGLU keeps them anyway). Inputs gate, up [M,F], A [R,F]; outputs hidden, u.
{
    const int64_t N = M * F;
#include "swiglu_forward.cc"
}
dnnl_sgemm('N', 'T', M, R, F, 1.f, out0_p, F, in2_p, F, 0.f, out1_p, R);
