// One row xm [D] -> probs_row [NT] and gamma (Sparse): the router (SwiGLU when HIDDEN > 0, else Linear),
// the sigmoid, Gamma and the selection. The weights' names and the sizes are routing.declare_router's.
std::vector<float> hidden(std::max<int64_t>(HIDDEN, 1));
for (int64_t j = 0; j < HIDDEN; j++) {
    const float g = dot(xm, W1 + j * D, D) + B1[j], u = dot(xm, W3 + j * D, D) + B3[j];
    hidden[j] = swiglu(g, u);
}
if (SPARSE) gamma = LEARNED ? MAX_THRESHOLD * sigmoid(dot(xm, GW, D) + GB[0]) : MAX_THRESHOLD;
for (int64_t i = 0; i < NT; i++) {
    float p = sigmoid(HIDDEN > 0 ? dot(hidden.data(), W2 + i * HIDDEN, HIDDEN) + B2[i] : dot(xm, W2 + i * D, D) + B2[i]);
    if (SPARSE && p - gamma < 0.f) p = 0.f;
    probs_row[i] = p;
}
