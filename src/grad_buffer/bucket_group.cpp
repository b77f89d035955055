#include "grad_buffer/bucket_group.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "common/check.h"

namespace fp8dp {

BucketGroup::BucketGroup(std::vector<const Bucket*> buckets, const std::vector<std::string>* names)
    : buckets_(std::move(buckets)), names_(names) {}

void BucketGroup::flag_local_nonfinite() {
  if (nonfinite_.defined()) return;
  // One multi-tensor L1 norm per group: NaN and Inf propagate through a sum of magnitudes, so a
  // parameter is flagged iff its norm is not finite. Everything stays on the device; the one host
  // read happens in GradSync::finish_grad_sync for all groups together (a .item() per bucket would
  // stall the backward pass at every launch).
  std::vector<at::Tensor> views;
  for (const Bucket* b : buckets_)
    for (size_t k = 0; k < b->params.size(); ++k)
      views.push_back(b->grad.narrow(0, b->param_starts[k], b->param_numels[k]));
  nonfinite_ = at::isfinite(at::stack(at::_foreach_norm(views, 1))).logical_not();
}

std::vector<int64_t> BucketGroup::flag_params() const {
  std::vector<int64_t> out;
  for (const Bucket* b : buckets_) out.insert(out.end(), b->params.begin(), b->params.end());
  return out;
}

std::vector<std::string> BucketGroup::nonfinite_names() const {
  std::vector<std::string> out;
  if (!nonfinite_.defined()) return out;
  const at::Tensor flags = nonfinite_.cpu();
  const bool* f = flags.const_data_ptr<bool>();
  const std::vector<int64_t> params = flag_params();
  for (size_t i = 0; i < params.size(); ++i)
    if (f[i]) out.push_back((*names_)[params[i]]);
  return out;
}

void BucketGroup::start_grad_sync(Communicator& comm, const SyncSettings& s) {
  FP8DP_CHECK(!launched_, "bucket group launched twice in one iteration");
  if (s.check_for_nan) flag_local_nonfinite();
  const int dp = comm.size();
  // One rank puts nothing on a wire, so nothing is rounded: the buffer path (an identity) runs.
  if (s.wire != Wire::kFP32 && dp > 1) {
    start_wire_reduce(comm, s);
    launched_ = true;
    return;
  }
  std::vector<at::Tensor> grads;
  for (const Bucket* b : buckets_) {
    if (!s.average_in_collective && dp > 1) b->grad.mul_(1.0 / dp);
    grads.push_back(b->grad);
  }
  const ReduceOp op = s.average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
  if (s.reduce_scatter) {
    std::vector<at::Tensor> chunks;
    for (const auto& g : grads) {
      const int64_t n = g.numel() / dp;
      chunks.push_back(g.narrow(0, comm.rank() * n, n));
    }
    grad_work_ = comm.reduce_scatter(grads, chunks, op);
  } else {
    grad_work_ = comm.all_reduce(grads, op);
  }
  launched_ = true;
}

void BucketGroup::finish_grad_sync() {
  if (!grad_work_) return;
  auto w = std::move(grad_work_);
  grad_work_.reset();
  if (wire_stage_ == WireStage::kNone) return w->wait();
  try {
    w->wait();
  } catch (...) {
    wire_stage_ = WireStage::kNone;  // the error says the reduction failed; nothing more to run
    throw;
  }
  finish_wire_reduce();
}

// The low-precision reduction of one group (grad_reduce_wire, C6 — collectives), in the order
// Megatron's reduce-scatter with FP32 accumulation uses: every rank encodes its (1/dp pre-scaled)
// bucket as dp chunks, sends chunk j to rank j (one grouped all-to-all; FP8 chunks travel with
// their scale_inv in the same call), and rank r sums the dp chunks it received in FP32, in rank
// order, into chunk r of the buffer. Its own chunk goes through the wire too (the all-to-all sends
// it to itself), so the sum is the same function of the ranks' gradients whichever rank owns the
// chunk. Without the distributed optimizer the owners then encode their sums and all-gather them;
// every rank, the owner included, writes the decoded values, so main_grad is bit-identical on all
// ranks (decoding is deterministic).
//
// The FP8 scales travel with the data rather than being agreed first by a MAX all-reduce: that
// would be a second collective, with a round trip, before any byte could be encoded, and a
// per-chunk scale fits each chunk's range at least as well as a shared one.
void BucketGroup::start_wire_reduce(Communicator& comm, const SyncSettings& s) {
  const int dp = comm.size();
  if (wire_.empty()) {
    for (const Bucket* b : buckets_) {
      FP8DP_CHECK_ARG(b->grad.scalar_type() == at::kFloat, "grad_reduce_wire: '", wire_name(s.wire),
                      "' encodes an FP32 gradient buffer, got a ", b->grad.scalar_type(),
                      " one (grad_reduce_in_fp32=False with low-precision parameters)");
      WireScratch w;
      w.m = (b->grad.numel() + dp - 1) / dp;
      auto f32 = b->grad.options().dtype(at::kFloat);
      w.send = at::zeros({dp * w.m}, b->grad.options().dtype(wire_dtype(s.wire)));
      w.recv = at::empty_like(w.send);
      w.send_scale = at::ones({dp}, f32);
      w.recv_scale = at::ones({dp}, f32);
      if (wire_is_fp8(s.wire)) w.tmp = at::empty({w.m}, f32);
      wire_.push_back(std::move(w));
    }
  }
  std::vector<at::Tensor> in, out;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const Bucket* b = buckets_[i];
    WireScratch& w = wire_[i];
    if (!s.average_in_collective) b->grad.mul_(1.0 / dp);
    encode_chunks(b->grad, s.wire, w.send, w.send_scale);
    in.push_back(w.send);
    out.push_back(w.recv);
    if (wire_is_fp8(s.wire)) {  // BF16's scale_inv is always 1: nothing to send
      in.push_back(w.send_scale);
      out.push_back(w.recv_scale);
    }
  }
  grad_work_ = comm.all_to_all(in, out);
  wire_stage_ = WireStage::kReduce;
  wire_comm_ = &comm;
  wire_settings_ = s;
}

void BucketGroup::finish_wire_reduce() {
  const SyncSettings& s = wire_settings_;
  Communicator& comm = *wire_comm_;
  const int dp = comm.size(), r = comm.rank();
  // With average_in_collective the 1/dp is applied to the FP32 sum instead of before encoding.
  const double post = s.average_in_collective ? 1.0 / dp : 1.0;
  if (wire_stage_ == WireStage::kReduce) {
    for (size_t i = 0; i < buckets_.size(); ++i) {
      const Bucket* b = buckets_[i];
      WireScratch& w = wire_[i];
      const int64_t len = std::clamp<int64_t>(b->grad.numel() - r * w.m, 0, w.m);
      decode_sum(w.recv, w.recv_scale, s.wire, b->grad.narrow(0, r * w.m, len), w.tmp, post);
    }
    if (s.reduce_scatter) {
      wire_stage_ = WireStage::kNone;
      return;
    }
    std::vector<at::Tensor> in, out;
    for (size_t i = 0; i < buckets_.size(); ++i) {
      const Bucket* b = buckets_[i];
      WireScratch& w = wire_[i];
      const int64_t len = std::clamp<int64_t>(b->grad.numel() - r * w.m, 0, w.m);
      const at::Tensor mine = w.send.narrow(0, r * w.m, w.m);
      const at::Tensor mine_scale = w.send_scale.narrow(0, r, 1);
      encode_chunks(b->grad.narrow(0, r * w.m, len), s.wire, mine, mine_scale);
      in.push_back(mine);
      out.push_back(w.recv);
      if (wire_is_fp8(s.wire)) {
        in.push_back(mine_scale);
        out.push_back(w.recv_scale);
      }
    }
    wire_stage_ = WireStage::kGather;
    try {
      comm.all_gather(in, out)->wait();
    } catch (...) {
      wire_stage_ = WireStage::kNone;
      throw;
    }
  }
  for (size_t i = 0; i < buckets_.size(); ++i)
    decode_chunks(wire_[i].recv, wire_[i].recv_scale, s.wire, buckets_[i]->grad);
  wire_stage_ = WireStage::kNone;
}

void BucketGroup::start_param_sync(Communicator& comm) {
  FP8DP_CHECK(!param_work_, "bucket group: parameter all-gather started twice without a finish");
  const int dp = comm.size();
  std::vector<at::Tensor> chunks, whole;
  for (const Bucket* b : buckets_) {
    const int64_t n = b->param.numel() / dp;
    chunks.push_back(b->param.narrow(0, comm.rank() * n, n));
    whole.push_back(b->param);
  }
  param_work_ = comm.all_gather(chunks, whole);
}

void BucketGroup::finish_param_sync() {
  if (!param_work_) return;
  auto w = std::move(param_work_);
  param_work_.reset();
  w->wait();
}

void BucketGroup::reset() {
  launched_ = false;
  wire_stage_ = WireStage::kNone;
  nonfinite_ = at::Tensor();
}

}  // namespace fp8dp
