// sgemm.h with the SwiGLU element and the standard containers: what the experts' ops
// (Models/kernels/experts.py) and the SwiGLU router (routing.py) build on.
#ifndef MOA_SGEMM_OPS_H
#define MOA_SGEMM_OPS_H
#include "sgemm.h"
#include "swiglu.h"
#include <vector>
#include <algorithm>
#endif
