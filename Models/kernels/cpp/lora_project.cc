// A decode step's projection with its LoRA expert: inputs x [M,K], the base's W [N,K], A [R,K], B [N,R]
// and, when WEIGHT names it, the type weight [M] -> y [M,N]
lora_project<M>(N, K, R, in0_p, in1_p, BASE_BF16, in2_p, in3_p, WEIGHT, 1, scale, out0_p);
