// A frozen base matrix W [N,K] as the kernels take it, in the storage --precision gave it: fp32, bf16
// bits, int8 values with a scale per row, or nf4 codes with a bf16 scale per group of 64 (nf4.h). Python
// declares one per weight (precision.matrix_code); the CPU's base_matrix.h and the GPU's cuda/products.cuh (not
// nf4: a GPU run takes the plain path) run the product its storage takes.
#ifndef MOA_STORAGE_H
#define MOA_STORAGE_H
enum Storage { FP32, BF16, INT8, NF4 };
struct BaseMatrix {
    const void *values;  // [N,K]: float, bf16 bits or int8; [N,K/2] nf4 codes, two a byte
    const void *scale;   // [N] fp32 for INT8, [N, ceil(K/64)] bf16 bits for NF4, else null
    Storage storage;
};
#endif
