// A decode step's routing of M rows x [M,D] in one op (about thirty ops op by op): outputs the type
// weights [M,NT], Gamma [M,1] (Sparse) and each type's column [M] (columns[i]: declared per call).
for (int64_t m = 0; m < M; m++) {
    const float *xm = in0_p + m * D;
    float *probs_row = out0_p + m * NT, gamma = 0.f;
#include "route_row.cc"
    for (int64_t i = 0; i < NT; i++) columns[i][m] = probs_row[i];
    if (SPARSE) out1_p[m] = gamma;
}
