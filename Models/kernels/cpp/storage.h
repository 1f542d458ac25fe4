// A frozen base matrix W [N,K] as the kernels take it, in the storage --precision gave it: fp32, bf16
// bits, or int8 values with a scale per row. Python declares one per weight (precision.matrix_code); the
// CPU's base_matrix.h and the GPU's cuda/products.cuh run the product its storage takes.
#ifndef MOA_STORAGE_H
#define MOA_STORAGE_H
enum Storage { FP32, BF16, INT8 };
struct BaseMatrix {
    const void *values;  // [N,K]: float, bf16 bits or int8
    const float *scale;  // [N] for INT8, else null
    Storage storage;
};
#endif
