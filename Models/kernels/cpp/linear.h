// The linears of Models/kernels/linear.py: oneDNN's sgemm, and the GEMV pass for a decode step's few rows.
#ifndef MOA_LINEAR_H
#define MOA_LINEAR_H
#include "sgemm.h"
#include "gemv.h"
#endif
