// y [M,N] = x [M,K] w [N,K]^T for a decode step's few rows: one GEMV pass over w
gemv(M, N, K, in0_p, in1_p, out0_p);
