// x [B,T,H,2*half] rotated pairwise by the angles of its position t: cos, sin [T,half], sign +-1.
#pragma omp parallel for
for (int64_t bt = 0; bt < B * T; bt++)
    for (int64_t h = 0; h < H; h++)
        rotate_pairs_row(in0_p + (bt * H + h) * 2 * half, out0_p + (bt * H + h) * 2 * half,
                         in1_p + (bt % T) * half, in2_p + (bt % T) * half, half, sign);
