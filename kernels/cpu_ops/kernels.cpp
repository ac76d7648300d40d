// The kernel files as one translation unit (a unity build, as CMake's UNITY_BUILD makes).
// Each includes aten.h, whose ATen headers take ~9 s of g++ to parse; compiled one by one
// they parsed them six times (66 s of g++ for the six, 26 s as one here; bind.cpp, the
// Python module, is the other unit, built beside this one). Names private to a file live
// in its anonymous namespace, which this unit shares: they must not repeat across files.
#include "ops.cpp"
#include "kv_copy.cpp"
#include "int4_gemv.cpp"
#include "int8_gemv.cpp"
#include "fused.cpp"
#include "batch_gemm.cpp"
