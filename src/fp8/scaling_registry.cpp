// The per-process registry of delayed-scaling states that update_fp8_scales() walks (C9).
#include "fp8/scaling_registry.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/check.h"
#include "fp8/recipe.h"
#include "fp8/scaling_state.h"
#include "fp8/scaling_update.h"

namespace fp8dp {
namespace {

struct Registry {
  std::mutex mu;
  int64_t next_id = 0;
  std::map<int64_t, ScalingState*> states;  // by creation
  std::map<std::string, int64_t> unnamed;   // states created per `what`, for default identities
  std::vector<int64_t> collected;           // ids behind the last registry_amaxes() result
  // Bumped whenever the registry's signature may change: a state allocated, resized, restored,
  // reset, renamed, cast with another recipe, or destroyed. The order, descriptions and hash are
  // recomputed only then, so the per-step check costs a comparison.
  std::atomic<uint64_t> generation{1};
  uint64_t cached_generation = 0;
  std::vector<int64_t> order;             // allocated states by (identity, creation)
  std::vector<std::string> descriptions;  // the states', then the noted recipes'
  int64_t hash = 0;                       // of the states' descriptions
  int64_t recipes_hash = -1;              // of the noted recipes' descriptions; -1: none
  // A non-empty cast recorded an amax (or a checkpoint brought one) since the last update.
  std::atomic<bool> observed{false};
  // Stateless recipes of the training forwards since the last update, by their fields (a key
  // compared per forward; the text is made only when the signature is recomputed).
  std::set<std::array<double, 10>> recipes;
};

std::array<double, 10> recipe_key(const Recipe& r) {
  const bool block = r.kind == RecipeKind::kBlock;
  return {static_cast<double>(r.kind),
          static_cast<double>(r.fwd_format),
          static_cast<double>(r.bwd_format),
          block ? 0.0 : r.margin,
          block ? double(r.block_inp.power_2_scale) : 0.0,
          block ? double(r.block_weight.power_2_scale) : 0.0,
          block ? double(r.block_grad.power_2_scale) : 0.0,
          block ? r.block_inp.amax_epsilon : 0.0,
          block ? r.block_weight.amax_epsilon : 0.0,
          block ? r.block_grad.amax_epsilon : 0.0};
}

std::string describe_recipe(const std::array<double, 10>& k) {
  std::ostringstream os;
  const auto fmt = [](double f) { return format_name(static_cast<Format>(static_cast<int>(f))); };
  os << "recipe without state: ";
  if (static_cast<RecipeKind>(static_cast<int>(k[0])) == RecipeKind::kBlock) {
    os << "Float8BlockScaling " << fmt(k[1]) << "/" << fmt(k[2]) << " power_2_scale=" << k[4] << ","
       << k[5] << "," << k[6] << " amax_epsilon=" << k[7] << "," << k[8] << "," << k[9];
  } else {
    os << "Float8CurrentScaling " << fmt(k[1]) << "/" << fmt(k[2]) << " margin=" << k[3];
  }
  return os.str();
}

Registry& registry() {
  static Registry r;
  return r;
}

void touch() { registry().generation.fetch_add(1); }

// FNV-1a, 64 bits, cut to 62 so that h and -h are both int64 values for the cross-rank check.
int64_t hash_of(const std::vector<std::string>& lines) {
  uint64_t h = 1469598103934665603ull;
  for (const std::string& line : lines) {
    for (unsigned char c : line) h = (h ^ c) * 1099511628211ull;
    h = (h ^ '\n') * 1099511628211ull;
  }
  return static_cast<int64_t>(h & ((uint64_t{1} << 62) - 1));
}

// reg.order and friends for the current generation; needs reg.mu.
void refresh(Registry& reg) {
  const uint64_t gen = reg.generation.load();
  if (gen == reg.cached_generation) return;
  std::vector<std::pair<std::string, int64_t>> keyed;
  for (auto& [id, st] : reg.states)
    if (st->allocated()) keyed.emplace_back(st->identity(), id);
  std::sort(keyed.begin(), keyed.end());
  reg.order.clear();
  reg.descriptions.clear();
  for (auto& [identity, id] : keyed) {
    reg.order.push_back(id);
    reg.descriptions.push_back(reg.states.at(id)->describe());
  }
  reg.hash = hash_of(reg.descriptions);
  std::vector<std::string> recipes;
  for (const auto& key : reg.recipes) recipes.push_back(describe_recipe(key));
  reg.recipes_hash = recipes.empty() ? -1 : hash_of(recipes);
  reg.descriptions.insert(reg.descriptions.end(), recipes.begin(), recipes.end());
  reg.cached_generation = gen;
}

}  // namespace

RegistryEntry registry_add(ScalingState* state, const std::string& what) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  RegistryEntry e;
  e.id = reg.next_id++;
  e.default_identity = "unnamed #" + std::to_string(reg.unnamed[what]++) + " " + what;
  reg.states[e.id] = state;
  return e;
}

void registry_remove(int64_t id, bool allocated) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.states.erase(id);
  if (allocated) touch();
}

void registry_touch() { touch(); }

void registry_mark_observed() { registry().observed.store(true); }

bool registry_observed() { return registry().observed.load(); }

void registry_set_observed(bool observed) { registry().observed.store(observed); }

void registry_note_recipe(const Recipe& recipe) {
  if (recipe.kind == RecipeKind::kDelayed) return;
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  if (reg.recipes.insert(recipe_key(recipe)).second) touch();
}

void registry_forget_recipes() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  if (reg.recipes.empty()) return;
  reg.recipes.clear();
  touch();
}

RegistrySignature registry_signature() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  refresh(reg);
  RegistrySignature sig;
  sig.hash = reg.hash;
  sig.recipes_hash = reg.recipes_hash;
  sig.observed = reg.observed.load();
  sig.size = static_cast<int64_t>(reg.order.size());
  return sig;
}

std::vector<std::string> registry_descriptions() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  refresh(reg);
  return reg.descriptions;
}

namespace {

// The allocated states in signature order (C9: (identity, creation), not the order of first
// casts), all on one device; their ids go to reg.collected. Caller holds reg.mu.
std::vector<ScalingState*> collect(Registry& reg) {
  refresh(reg);
  reg.collected.clear();
  // States restored from a checkpoint that no cast has placed yet join the device of the others:
  // an update right after loading a checkpoint into a GPU model would otherwise find them on the
  // CPU beside the GPU states of modules that did cast.
  for (int64_t id : reg.order) {
    ScalingState* st = reg.states.at(id);
    if (!st->unplaced()) {
      const at::Device device = st->amax_history().device();
      for (int64_t other : reg.order) reg.states.at(other)->place(device);
      break;
    }
  }
  std::vector<ScalingState*> states;
  for (int64_t id : reg.order) {
    ScalingState* st = reg.states.at(id);
    if (!states.empty()) {
      // Named by identity: the state on the unexpected device is usually a module the caller
      // forgot was still alive (an old model, a graph kept by a stored tensor).
      FP8DP_CHECK(states.front()->amax_history().device() == st->amax_history().device(),
                  "update_fp8_scales: FP8 states live on different devices ('",
                  states.front()->identity(), "' on ", states.front()->amax_history().device(),
                  ", '", st->identity(), "' on ", st->amax_history().device(),
                  "); one process updates the states of one device");
    }
    states.push_back(st);
    reg.collected.push_back(id);
  }
  return states;
}

}  // namespace

at::Tensor registry_amaxes() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<at::Tensor> parts;
  for (ScalingState* st : collect(reg)) parts.push_back(st->current_amax());
  if (parts.empty()) return at::empty({0}, at::kFloat);
  // A NaN or Inf amax is no observation (C7, scaling.h): it becomes 0 before the cross-rank MAX,
  // where it would otherwise hide the other ranks' finite amaxes of the step (a NaN wins or loses
  // depending on the order the collective reduces in).
  return at::cat(parts).nan_to_num_(0.0, 0.0, 0.0);
}

void registry_update_local() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const std::vector<ScalingState*> states = collect(reg);
  reg.observed.store(false);
  reg.collected.clear();
  if (states.empty()) return;
  // Each state's row 0 is already the step's amax: no gather into one tensor (an allocation and a
  // device copy per step, for nothing to reduce). note_reduced reads row 0 before the update
  // rolls it: both are enqueued in this order on the same stream.
  std::vector<ScalingSlot> slots;
  slots.reserve(states.size());
  for (ScalingState* st : states) {
    st->note_reduced(st->current_amax());
    slots.push_back(st->update_slot(nullptr));
  }
  update_scaling_batched(slots, states.front()->amax_history().device());
}

void registry_update(const at::Tensor& reduced) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  const int64_t n = static_cast<int64_t>(reg.collected.size()) * kNumRoles;
  FP8DP_CHECK_ARG(reduced.dim() == 1 && reduced.numel() == n && reduced.scalar_type() == at::kFloat,
                  "update_fp8_scales: 'reduced' must be float32 [", n,
                  "] (the result of registry_amaxes), got ", reduced.scalar_type(), " ",
                  reduced.sizes());
  reg.observed.store(false);
  if (n == 0) return;
  std::vector<ScalingSlot> slots;
  std::vector<ScalingState*> states;
  slots.reserve(reg.collected.size());
  std::optional<at::Device> device;
  at::Tensor values;  // `reduced` on the states' device; kept alive until the update is enqueued
  for (int64_t id : reg.collected) {
    auto it = reg.states.find(id);
    FP8DP_CHECK(it != reg.states.end() && it->second->allocated(),
                "update_fp8_scales: an FP8 state was destroyed between collecting and updating");
    if (!device) {
      device = it->second->amax_history().device();
      values = reduced.to(*device).contiguous();
    }
    // registry_amaxes checked that every collected state lives on one device.
    const int64_t off = static_cast<int64_t>(slots.size()) * kNumRoles;
    slots.push_back(it->second->update_slot(values.data_ptr<float>() + off));
    states.push_back(it->second);
  }
  // One launch for the whole model on CUDA (the per-state updates were one copy and one launch
  // each, 2 x modules launches per step).
  update_scaling_batched(slots, *device);
  for (size_t i = 0; i < states.size(); ++i) {
    states[i]->note_reduced(values.narrow(0, static_cast<int64_t>(i) * kNumRoles, kNumRoles));
  }
  reg.collected.clear();
}

int64_t registry_size() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  refresh(reg);
  return static_cast<int64_t>(reg.order.size());
}

}  // namespace fp8dp
