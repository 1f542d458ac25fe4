// A decode step's projection with its LoRA expert: x [M,K], the base's W (a BaseMatrix), A [R,K], B [N,R]
// and the type weight [M] or null, as declared per call -> y [M,N]
lora_project(M, N, K, R, x, W, A, B, WEIGHT, 1, scale, out0_p);
