// The KV wire's copies in one pass each (shared/kv/wire.py): torch's
// index_copy_ scatters a 192 KiB write in ~60 us and a 7 MiB one in ~1.9 ms where these
// row memcpys take ~10 us and ~0.3 ms; a gather skips index_select's tensor setup.
//
// A pool kv [L, 2, NB, BS, Hkv, D] (contiguous, CPU) is rows of E = BS*Hkv*D elements:
// row (l*2 + k)*NB + b is layer l's K (k=0) or V (k=1) of block b. A write's payload
// [l1-l0, 2, n, BS, Hkv, D] is the rows ((l-l0)*2 + k)*n + i <- pool row (l*2+k)*NB + ids[i].

#include "aten.h"
#include <pybind11/pybind11.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace py = pybind11;

namespace {

// A buffer's bytes, refused unless they are one C-contiguous run: pybind11's request()
// accepts strided views (mv[::2]), which a flat memcpy would read or write past.
int64_t flat_bytes(const py::buffer_info& b, const char* what) {
  TORCH_CHECK(PyBuffer_IsContiguous(b.view(), 'C'), what, ": the buffer is not contiguous");
  return b.size * b.itemsize;
}

struct Rows {
  char* base;
  int64_t nb, row;   // blocks in the pool, bytes per row
};

Rows pool_rows(const at::Tensor& kv, const std::vector<int64_t>& ids, int64_t l0,
               int64_t l1, int64_t payload_bytes, const char* what) {
  TORCH_CHECK(kv.device().is_cpu() && kv.is_contiguous() && kv.dim() == 6 && kv.size(1) == 2,
              what, ": a contiguous CPU pool [L, 2, NB, BS, Hkv, D]");
  TORCH_CHECK(0 <= l0 && l0 < l1 && l1 <= kv.size(0), what, ": layers out of range");
  const int64_t nb = kv.size(2);
  for (int64_t b : ids) TORCH_CHECK(0 <= b && b < nb, what, ": block id out of range");
  const int64_t row = kv.size(3) * kv.size(4) * kv.size(5) * kv.element_size();
  const int64_t want = (l1 - l0) * 2 * static_cast<int64_t>(ids.size()) * row;
  TORCH_CHECK(payload_bytes == want, what, ": payload of ", payload_bytes, " bytes, want ",
              want);
  return {static_cast<char*>(kv.data_ptr()), nb, row};
}

template <typename F>
void each_row(const Rows& r, const std::vector<int64_t>& ids, int64_t l0, int64_t l1, F f) {
  const int64_t n = static_cast<int64_t>(ids.size());
  int64_t j = 0;
  for (int64_t l = l0; l < l1; ++l)
    for (int64_t k = 0; k < 2; ++k)
      for (int64_t i = 0; i < n; ++i, ++j) f(r.base + ((l * 2 + k) * r.nb + ids[i]) * r.row, j);
}

}  // namespace

// pool -> payload (a writable buffer of exactly the write's bytes)
void kv_gather(const at::Tensor& kv, const std::vector<int64_t>& ids, int64_t l0,
               int64_t l1, py::buffer out) {
  py::buffer_info dst = out.request(true);
  const int64_t bytes = flat_bytes(dst, "kv_gather");
  Rows r = pool_rows(kv, ids, l0, l1, bytes, "kv_gather");
  char* d = static_cast<char*>(dst.ptr);
  py::gil_scoped_release nogil;
  each_row(r, ids, l0, l1, [&](const char* src, int64_t j) { std::memcpy(d + j * r.row, src, r.row); });
}

// payload -> pool, in place
void kv_scatter(at::Tensor& kv, const std::vector<int64_t>& ids, int64_t l0, int64_t l1,
                py::buffer payload) {
  py::buffer_info src = payload.request(false);
  const int64_t bytes = flat_bytes(src, "kv_scatter");
  Rows r = pool_rows(kv, ids, l0, l1, bytes, "kv_scatter");
  const char* s = static_cast<const char*>(src.ptr);
  py::gil_scoped_release nogil;
  each_row(r, ids, l0, l1, [&](char* dst, int64_t j) { std::memcpy(dst, s + j * r.row, r.row); });
}

