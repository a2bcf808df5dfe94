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
// about the mean: stats._CANCELLATION_SHARE; in the accumulation dtype). Outputs: the float64 record in
// metadata.FIELDS' order, and the plain sum in the accumulation dtype (finite
// exactly when no value is NaN or Inf, unless the sum itself overflows).
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

template <typename F>
class RecordOp : public OpKernel {
 public:
  explicit RecordOp(OpKernelConstruction* c) : OpKernel(c) {}

  void Compute(OpKernelContext* c) override {
    ExactSubnormals exact;  // here too: combining the parts compares subnormal extrema
    const Tensor& flat = c->input(0);  // of any shape, read as flat
    const Tensor& limits = c->input(1);
    OP_REQUIRES(c, limits.NumElements() == 3,
                tensorflow::errors::InvalidArgument("TbnRecord: limits must be [tiny, margin, share]"));
    const F* x = flat.flat<F>().data();
    const F tiny = limits.flat<F>()(0), margin = limits.flat<F>()(1);
    const double share = limits.flat<F>()(2);
    const int64_t n = flat.NumElements();
    const int64_t shards = std::max<int64_t>(1, std::min<int64_t>(64, n / kShardMin));
    auto* pool = c->device()->tensorflow_cpu_worker_threads()->workers;

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
    const double plain_sum = r.sum;
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
    Tensor* record = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(0, TensorShape({11}), &record));
    std::copy(fields, fields + 11, record->flat<double>().data());
    Tensor* total = nullptr;
    OP_REQUIRES_OK(c, c->allocate_output(1, TensorShape({}), &total));
    total->scalar<F>()() = static_cast<F>(plain_sum);
  }
};

}  // namespace

REGISTER_OP("TbnRecord")
    .Input("values: T")
    .Input("limits: T")
    .Output("record: float64")
    .Output("total: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      c->set_output(0, c->Vector(11));
      c->set_output(1, c->Scalar());
      return tensorflow::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TbnRecord").Device(tensorflow::DEVICE_CPU).TypeConstraint<float>("T"), RecordOp<float>);
REGISTER_KERNEL_BUILDER(Name("TbnRecord").Device(tensorflow::DEVICE_CPU).TypeConstraint<double>("T"), RecordOp<double>);
