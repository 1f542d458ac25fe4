// dbias = g^T w scale, after add_projected_backward.cc where the expert has a bias.
std::vector<float> ws(M);
for (int64_t m = 0; m < M; m++) ws[m] = w[m] * scale;
dnnl_sgemm('T', 'N', N, 1, M, 1.f, g, N, ws.data(), 1, 0.f, out3_p, 1);
