// x [N] (fp32) rounded to bf16 into out [N] of OUT_T: bf16 bits (uint16_t) or their fp32 values (float)
round_into((const float *)in0_p, N, (OUT_T *)out0_p);
