// out [N] = silu(gate) * up
swiglu_into(in0_p, in1_p, N, out0_p);
