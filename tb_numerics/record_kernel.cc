// The numerics record of a flat float tensor in one TensorFlow CPU kernel.
//
// What stats.py's healthy path computes with some twenty TensorFlow ops,
// each a pass over the tensor and a node to instantiate at every call site,
// this kernel computes in one vectorised pass (two for a tensor holding
// zeros or values below the smallest normal, such as a ReLU output). The
// record is that of records.numpy_stats: counts and extrema exact, sums
// accumulated in the tensor's accumulation dtype within blocks of 8,192
// values and in double across blocks.
//
// TensorFlow runs CPU kernels with denormals-are-zero and flush-to-zero
// set; the kernel and each of its shards clear both while they run (and
// put them back), so that a subnormal compares, sums and bounds the
// extrema as itself.
//
// Inputs: values (float or double, the accumulation dtype's; any shape,
// read as flat) and
// limits ([smallest normal, overflow margin] of the tensor's own dtype, and
// the share of the mean square below which the variance is summed again
// about the mean: stats._CANCELLATION_SHARE; in the accumulation dtype).
// Output: the float64 record in metadata.FIELDS' order. TbnRecords, below,
// takes a list of tensors; TbnKeep and TbnMoved make a due step's weights'
// records, their copy before the update and how far each moved, where a
// bool input says the step is due (at no cost elsewhere, so with no cond).
#if !defined(__x86_64__)
#error "the record kernel is built for x86-64 only; elsewhere stats.py's TensorFlow ops serve"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

constexpr int64_t kBlock = 8192;        // values summed in the accumulation dtype before a double sum
constexpr int64_t kShardMin = 1 << 16;  // fewer values than this per thread are not worth a thread

// Clears denormals-are-zero and flush-to-zero for this scope.
class ExactSubnormals {
 public:
  ExactSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }
  ~ExactSubnormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
};

struct Part {
  double sum = 0, sum_sq = 0;
  double lo = std::numeric_limits<double>::infinity(), hi = -std::numeric_limits<double>::infinity();
  double small = std::numeric_limits<double>::infinity();  // the smallest magnitude
  int64_t nan = 0, posinf = 0, neginf = 0, zeros = 0, underflow = 0, overflow = 0;
};

// The healthy pass: sums, extrema and the smallest magnitude. A NaN or Inf
// makes the sum of squares non-finite, so the caller can decide on it.
template <typename F>
void Sums(const F* x, int64_t n, Part* p) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t end = std::min(n, i + kBlock);
    F s = 0, q = 0, lo = std::numeric_limits<F>::infinity(), hi = -lo, small = lo;
#pragma omp simd reduction(+ : s, q) reduction(min : lo, small) reduction(max : hi)
    for (int64_t k = i; k < end; ++k) {
      const F v = x[k];
      s += v;
      q += v * v;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      const F a = std::fabs(v);
      small = a < small ? a : small;
    }
    p->sum += s;
    p->sum_sq += q;
    p->lo = std::min<double>(p->lo, lo);
    p->hi = std::max<double>(p->hi, hi);
    p->small = std::min<double>(p->small, small);
  }
}

// The counts of a finite tensor: zeros and values below the smallest
// normal, and (``beyond``: only where the largest magnitude is) values
// beyond the overflow margin. Counted in 32-bit lanes within a block.
template <typename F, bool beyond>
void Counts(const F* x, int64_t n, F tiny, F margin, Part* p) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t end = std::min(n, i + kBlock);
    int32_t zeros = 0, underflow = 0, overflow = 0;
#pragma omp simd reduction(+ : zeros, underflow, overflow)
    for (int64_t k = i; k < end; ++k) {
      const F a = std::fabs(x[k]);
      zeros += a == F(0);
      underflow += (a > F(0)) & (a < tiny);
      if (beyond) overflow += a > margin;
    }
    p->zeros += zeros;
    p->underflow += underflow;
    p->overflow += overflow;
  }
}

// Everything over the finite values, in double, with the non-finite ones
// counted: only for a tensor whose healthy pass failed.
template <typename F>
void Unhealthy(const F* x, int64_t n, F tiny, F margin, Part* p) {
  const F inf = std::numeric_limits<F>::infinity();
  for (int64_t k = 0; k < n; ++k) {
    const F v = x[k];
    if (std::isnan(v)) {
      ++p->nan;
    } else if (v == inf) {
      ++p->posinf;
    } else if (v == -inf) {
      ++p->neginf;
    } else {
      const double d = v;
      p->sum += d;
      p->sum_sq += d * d;
      p->lo = std::min(p->lo, d);
      p->hi = std::max(p->hi, d);
      const F a = std::fabs(v);
      p->zeros += a == F(0);
      p->underflow += (a > F(0)) & (a < tiny);
      p->overflow += a > margin;
    }
  }
}

// Sums of the deviations from ``shift``, for a tensor whose variance is a
// tiny share of its mean square (values of 1000 +- 0.01).
template <typename F>
void Centred(const F* x, int64_t n, F shift, Part* p) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t end = std::min(n, i + kBlock);
    F s = 0, q = 0;
#pragma omp simd reduction(+ : s, q)
    for (int64_t k = i; k < end; ++k) {
      const F d = x[k] - shift;
      s += d;
      q += d * d;
    }
    p->sum += s;
    p->sum_sq += q;
  }
}

// The record of the ``n`` values at ``x`` into ``out`` (metadata.FIELDS'
// order), sharded over ``pool`` with a split fixed by ``n``, so that the
// sums do not depend on timing.
template <typename F>
void RecordOf(const F* x, int64_t n, F tiny, F margin, double share, tensorflow::thread::ThreadPool* pool,
              double* out) {
  ExactSubnormals exact;  // here too: combining the parts compares subnormal extrema
  const int64_t shards = std::max<int64_t>(1, std::min<int64_t>(64, n / kShardMin));

  // Runs ``pass`` over each shard's slice into its own part; the parts
  // are combined in shard order, so the sums do not depend on timing.
  auto over_shards = [&](auto pass) {
    std::vector<Part> parts(shards);
    auto work = [&](int64_t a, int64_t b) {
      ExactSubnormals exact;
      for (int64_t s = a; s < b; ++s) {
        const int64_t lo = n * s / shards, hi = n * (s + 1) / shards;
        pass(x + lo, hi - lo, &parts[s]);
      }
    };
    if (shards > 1) {
      pool->ParallelFor(shards, kShardMin * 8, work);
    } else {
      work(0, 1);
    }
    Part all;
    for (const Part& p : parts) {
      all.sum += p.sum;
      all.sum_sq += p.sum_sq;
      all.lo = std::min(all.lo, p.lo);
      all.hi = std::max(all.hi, p.hi);
      all.small = std::min(all.small, p.small);
      all.nan += p.nan;
      all.posinf += p.posinf;
      all.neginf += p.neginf;
      all.zeros += p.zeros;
      all.underflow += p.underflow;
      all.overflow += p.overflow;
    }
    return all;
  };

  Part r = over_shards([](const F* v, int64_t m, Part* p) { Sums(v, m, p); });
  if (std::isfinite(r.sum_sq) && std::isfinite(r.sum)) {
    if (r.small < tiny || std::max(-r.lo, r.hi) > margin) {
      const bool beyond = std::max(-r.lo, r.hi) > margin;
      const Part k = over_shards([&](const F* v, int64_t m, Part* p) {
        beyond ? Counts<F, true>(v, m, tiny, margin, p) : Counts<F, false>(v, m, tiny, margin, p);
      });
      r.zeros = k.zeros;
      r.underflow = k.underflow;
      r.overflow = k.overflow;
    }
    const double count = n, safe_n = std::max<double>(count, 1.0);
    const double mean_sq = r.sum_sq / safe_n, mean = r.sum / safe_n;
    if (n > 1 && mean_sq - mean * mean < share * mean_sq) {
      const F shift = static_cast<F>(mean);
      const Part d = over_shards([&](const F* v, int64_t m, Part* p) { Centred(v, m, shift, p); });
      const double d1 = d.sum / safe_n, d2 = d.sum_sq / safe_n;
      const double exact_mean = double(shift) + d1;
      const double var = std::max(d2 - d1 * d1, 0.0);
      r.sum = exact_mean * count;
      r.sum_sq = (var + exact_mean * exact_mean) * count;
    }
  } else {
    r = over_shards([&](const F* v, int64_t m, Part* p) { Unhealthy(v, m, tiny, margin, p); });
  }

  const bool any_finite = n > r.nan + r.posinf + r.neginf;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double fields[11] = {
      double(n), double(r.nan), double(r.posinf), double(r.neginf),
      any_finite ? r.lo : nan, any_finite ? r.hi : nan, r.sum, r.sum_sq,
      double(r.zeros), double(r.overflow), double(r.underflow),
  };
  std::copy(fields, fields + 11, out);
}

// Where each of ``values`` starts in their flat concatenation; the last
// entry is their total size.
std::vector<int64_t> Offsets(const tensorflow::OpInputList& values) {
  std::vector<int64_t> offset(values.size() + 1, 0);
  for (int i = 0; i < values.size(); ++i) offset[i + 1] = offset[i] + values[i].NumElements();
  return offset;
}

// (tensor, first value) of each block of ``size`` values of each of ``values``.
std::vector<std::pair<int64_t, int64_t>> Blocks(const tensorflow::OpInputList& values, int64_t size) {
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int i = 0; i < values.size(); ++i) {
    for (int64_t j = 0; j < values[i].NumElements(); j += size) blocks.emplace_back(i, j);
  }
  return blocks;
}

// The records of ``values`` into ``out``, a row of 11 each, ``limits``
// holding each one's row of three (checked by the caller).
template <typename F>
void RecordsOf(const tensorflow::OpInputList& values, const Tensor& limits, tensorflow::thread::ThreadPool* pool,
               double* out) {
  const auto l = limits.matrix<F>();
  for (int i = 0; i < values.size(); ++i) {
    RecordOf<F>(values[i].flat<F>().data(), values[i].NumElements(), l(i, 0), l(i, 1), l(i, 2), pool,
                out + 11 * i);
  }
}

// Whether ``limits`` holds a row of three for each of ``k`` tensors.
bool LimitsPerTensor(const Tensor& limits, int64_t k) {
  return limits.dims() == 2 && limits.dim_size(0) == k && limits.dim_size(1) == 3;
}

template <typename F>
class RecordOp : public OpKernel {
 public:
  explicit RecordOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* c) override {
    const Tensor& flat = c->input(0);  // of any shape, read as flat
    const Tensor& limits = c->input(1);
    OP_REQUIRES(c, limits.NumElements() == 3,
                tensorflow::errors::InvalidArgument("TbnRecord: limits must be [tiny, margin, share]"));
    const auto l = limits.flat<F>();
    Tensor* record = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({11}), &record));
    RecordOf<F>(flat.flat<F>().data(), flat.NumElements(), l(0), l(1), l(2),
                c->device()->tensorflow_cpu_worker_threads()->workers, record->flat<double>().data());
  }
};

// The records of a list of tensors, one row each: one node for many.
template <typename F>
class RecordsOp : public OpKernel {
 public:
  explicit RecordsOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* c) override {
    tensorflow::OpInputList values;
    OP_REQUIRES_OK(c, c->input_list("values", &values));
    const Tensor& limits = c->input(values.size());
    const int64_t k = values.size();
    OP_REQUIRES(c, LimitsPerTensor(limits, k),
                tensorflow::errors::InvalidArgument("TbnRecords: limits must be [tensors, 3]"));
    Tensor* records = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({k, 11}), &records));
    RecordsOf<F>(values, limits, c->device()->tensorflow_cpu_worker_threads()->workers,
                 records->flat<double>().data());
  }
};

// A due step's weights, with no cond around them: where ``due``, the
// records of the tensors (attr ``record``) and a copy of their values, flat
// and in order (attr ``copy``: what they were before the update writes
// them); elsewhere zero records and an empty copy, at no cost.
template <typename F>
class KeepOp : public OpKernel {
 public:
  explicit KeepOp(OpKernelConstruction* c) : OpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("record", &record_));
    OP_REQUIRES_OK(c, c->GetAttr("copy", &copy_));
  }

  void Compute(OpKernelContext* c) override {
    tensorflow::OpInputList values;
    OP_REQUIRES_OK(c, c->input_list("values", &values));
    const int64_t k = values.size();
    const Tensor& limits = c->input(k);
    const bool due = c->input(k + 1).scalar<bool>()();
    OP_REQUIRES(c, LimitsPerTensor(limits, k),
                tensorflow::errors::InvalidArgument("TbnKeep: limits must be [tensors, 3]"));
    const std::vector<int64_t> offset = Offsets(values);
    Tensor* records = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({record_ ? k : 0, 11}), &records));
    Tensor* kept = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(1, TensorShape({due && copy_ ? offset[k] : 0}), &kept));
    records->flat<double>().setZero();
    if (!due) return;
    auto* pool = c->device()->tensorflow_cpu_worker_threads()->workers;
    if (record_) RecordsOf<F>(values, limits, pool, records->flat<double>().data());
    if (copy_) {
      F* to = kept->flat<F>().data();
      const auto blocks = Blocks(values, kShardMin);
      pool->ParallelFor(blocks.size(), kShardMin, [&](int64_t a, int64_t b) {
        for (int64_t s = a; s < b; ++s) {
          const auto [i, j] = blocks[s];
          const int64_t m = std::min<int64_t>(kShardMin, values[i].NumElements() - j);
          std::copy_n(values[i].flat<F>().data() + j, m, to + offset[i] + j);
        }
      });
    }
  }

 private:
  bool record_ = true;
  bool copy_ = true;
};

// Where ``due``, [||new_i - old_i||^2, ||old_i||^2] of each tensor new_i,
// old_i its values' slice of the flat ``old`` (TbnKeep's copy), summed in
// double: the update ratios' numerators and denominators, one node for
// every weight; elsewhere zeros.
template <typename F>
class MovedOp : public OpKernel {
 public:
  explicit MovedOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* c) override {
    tensorflow::OpInputList values;
    OP_REQUIRES_OK(c, c->input_list("values", &values));
    const Tensor& old = c->input(values.size());
    const bool due = c->input(values.size() + 1).scalar<bool>()();
    const int64_t k = values.size();
    Tensor* moved = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({k, 2}), &moved));
    auto out = moved->matrix<double>();
    out.setZero();
    if (!due) return;
    const std::vector<int64_t> offset = Offsets(values);
    OP_REQUIRES(c, old.NumElements() == offset[k],
                tensorflow::errors::InvalidArgument("TbnMoved: old holds ", old.NumElements(),
                                                    " values, the tensors ", offset[k]));
    const F* before = old.flat<F>().data();
    // Blocks of kBlock values, each summed on its own, then in order per tensor.
    const auto blocks = Blocks(values, kBlock);
    std::vector<std::pair<double, double>> sums(blocks.size());
    auto work = [&](int64_t a, int64_t b) {
      for (int64_t s = a; s < b; ++s) {
        const auto [i, j] = blocks[s];
        const F* x = values[i].flat<F>().data() + j;
        const F* y = before + offset[i] + j;
        const int64_t m = std::min<int64_t>(kBlock, values[i].NumElements() - j);
        double q = 0, o = 0;
#pragma omp simd reduction(+ : q, o)
        for (int64_t t = 0; t < m; ++t) {
          const double d = double(x[t]) - double(y[t]);
          q += d * d;
          o += double(y[t]) * double(y[t]);
        }
        sums[s] = {q, o};
      }
    };
    c->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(blocks.size(), kBlock * 4, work);
    for (size_t s = 0; s < blocks.size(); ++s) {
      out(blocks[s].first, 0) += sums[s].first;
      out(blocks[s].first, 1) += sums[s].second;
    }
  }
};

// The shape of an op over a list of N tensors: a row of ``columns`` values per tensor.
tensorflow::Status PerTensorShape(tensorflow::shape_inference::InferenceContext* c, int64_t columns) {
  int64_t n;
  TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
  c->set_output(0, c->Matrix(n, columns));
  return tensorflow::OkStatus();
}

}  // namespace

// An op's CPU kernels for float and double values.
#define TBN_CPU_KERNELS(name, Op)                                                                   \
  REGISTER_KERNEL_BUILDER(Name(name).Device(tensorflow::DEVICE_CPU).TypeConstraint<float>("T"), Op<float>); \
  REGISTER_KERNEL_BUILDER(Name(name).Device(tensorflow::DEVICE_CPU).TypeConstraint<double>("T"), Op<double>)

REGISTER_OP("TbnRecord")
    .Input("values: T")
    .Input("limits: T")
    .Output("record: float64")
    .Attr("T: {float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(11));
      return tensorflow::OkStatus();
    });

TBN_CPU_KERNELS("TbnRecord", RecordOp);

REGISTER_OP("TbnRecords")
    .Input("values: N * T")
    .Input("limits: T")
    .Output("records: float64")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) { return PerTensorShape(c, 11); });

TBN_CPU_KERNELS("TbnRecords", RecordsOp);

REGISTER_OP("TbnKeep")
    .Input("values: N * T")
    .Input("limits: T")
    .Input("due: bool")
    .Output("records: float64")
    .Output("kept: T")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .Attr("record: bool = true")
    .Attr("copy: bool = true")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      int64_t n;
      bool record;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("record", &record));
      c->set_output(0, c->Matrix(record ? n : 0, 11));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return tensorflow::OkStatus();
    });

TBN_CPU_KERNELS("TbnKeep", KeepOp);

REGISTER_OP("TbnMoved")
    .Input("values: N * T")
    .Input("old: T")
    .Input("due: bool")
    .Output("moved: float64")
    .Attr("N: int >= 1")
    .Attr("T: {float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) { return PerTensorShape(c, 2); });

TBN_CPU_KERNELS("TbnMoved", MovedOp);
