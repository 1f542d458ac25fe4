// y [M,N] = x [M,K] w [N,K]^T through oneDNN's sgemm
dnnl_sgemm('N', 'T', M, N, K, 1.f, in0_p, K, in1_p, K, 0.f, out0_p, N);
