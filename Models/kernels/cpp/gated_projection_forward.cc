// hidden [M,F] = silu(gate) * up and u [M,R] = hidden A [R,F]^T in one op that keeps only gate and up
// (the SwiGLU keeps them anyway; GATE_T: fp32, or bf16 bits). Inputs gate, up [M,F], A [R,F]; outputs
// hidden, u.
swiglu_into((const GATE_T *)in0_p, (const GATE_T *)in1_p, M * F, out0_p);
dnnl_sgemm('N', 'T', M, R, F, 1.f, out0_p, F, in2_p, F, 0.f, out1_p, R);
