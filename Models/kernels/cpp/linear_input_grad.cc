// dx [M,K] = g [M,N] W [N,K] (g is input 0, W declared per call)
dnnl_sgemm('N', 'N', M, K, N, 1.f, in0_p, N, W, K, 0.f, out0_p, K);
