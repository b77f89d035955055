// The per-process registry of delayed-scaling states (C9): every ScalingState joins it when
// created; update_fp8_scales() reduces the step's amaxes of all of them across ranks and updates
// their scales once per step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fp8dp {

class ScalingState;
struct Recipe;

// The registry (update_fp8_scales is Python glue around these calls and two all_reduces).
// Its states are the allocated ones, ordered by (identity, creation): the same order on every
// rank that runs the same FP8 modules, whatever order they were created or first cast in (C9).
// registry_signature(): a 62-bit hash of every state's describe() in that order (recomputed only
// when the set, an identity or a recipe changed since the last call) and whether any non-empty
// cast recorded an amax (or a checkpoint brought a step's amaxes) since the last update.
// registry_descriptions(): the describe() strings in that order (for the error on a mismatch),
// then the stateless recipes noted since the last update (registry_note_recipe).
// registry_amaxes() concatenates row 0 of every state, in that order, into one flat float32
// tensor, NaN and Inf as 0 (no observation); registry_update(reduced) writes the (cross-rank
// MAX-reduced) values back and runs update_scaling on every state: new scales from the history,
// history rolled once.
struct RegistrySignature {
  int64_t hash = 0;  // in [0, 2^62): h and -h both fit an int64 for the cross-rank MAX check
  int64_t recipes_hash = -1;  // the noted stateless recipes' (registry_note_recipe); -1: none
  bool observed = false;
  int64_t size = 0;
};
RegistrySignature registry_signature();
std::vector<std::string> registry_descriptions();
at::Tensor registry_amaxes();
void registry_update(const at::Tensor& reduced);
// registry_update(registry_amaxes()) without the gather: for a process with nothing to reduce
// across (no process group, or one rank), where row 0 of every state already holds its amaxes.
void registry_update_local();
int64_t registry_size();  // allocated states

// ScalingState's side (scaling_state.cpp). A new state joins under a fresh id with the default
// identity "unnamed #k <what>" (k counts the states created with the same `what`); a destroyed
// one leaves (`allocated`: whether it was part of the signature).
struct RegistryEntry {
  int64_t id = 0;
  std::string default_identity;
};
RegistryEntry registry_add(ScalingState* state, const std::string& what);
void registry_remove(int64_t id, bool allocated);
// The signature may have changed: a state allocated, resized, restored, reset, renamed or cast
// with another recipe. The order, descriptions and hash are recomputed at the next query only.
void registry_touch();
// A non-empty cast recorded an amax (or a checkpoint brought one) since the last update.
void registry_mark_observed();
// The flag itself, for fp8dp.make_graphed_callables (modules/graph_record.h): a capture runs the
// layers' host code without running their kernels, so the mark it leaves is not an observation;
// the record reads it, puts the previous value back, and marks again at each replay.
bool registry_observed();
void registry_set_observed(bool observed);

// Recipes without scaling state (current and block scaling) that a training forward used since
// the last update. They have their own hash in the signature (compared across the ranks that
// noted any: a rank that ran no training forward this step has nothing to disagree with) and
// follow the states in the descriptions, as "recipe without state: ...", so ranks that train
// with another such recipe (block on one, current on another) fail the check, naming the
// recipes: no state records them otherwise. A delayed recipe is not noted (its states describe
// it). update_fp8_scales forgets them once the ranks agreed.
void registry_note_recipe(const Recipe& recipe);
void registry_forget_recipes();

}  // namespace fp8dp
