// inputs gate, up, d [N] -> dgate, dup
swiglu_grads_into(in0_p, in1_p, in2_p, N, out0_p, out1_p);
