// C9 in ScalingState and its registry: identities order the reduction, the signature changes only
// with the set, empty casts are no observation, inference casts change no state, and restore
// refuses impossible values. The Python tests (test_fp8_registry*.py) cover the same through the
// modules and across ranks.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "common/check.h"
#include "fp8/cast.h"
#include "fp8/scaling_registry.h"
#include "fp8/scaling_state.h"

namespace fp8dp {
namespace {

Recipe delayed(int64_t len = 4, float margin = 0.0f) {
  Recipe r;
  r.amax_history_len = len;
  r.margin = margin;
  return r;
}

// Clears the registry's "observed" flag left by an earlier test (its states are gone).
void settle() { registry_update(registry_amaxes()); }

TEST(Fp8Registry, EmptyCastIsNoObservation) {
  settle();
  ScalingState st;
  st.cast(at::empty({0, 16}), Role::kInput, delayed(), QuantizeOptions{});
  ASSERT_TRUE(st.allocated());  // the module took part in the step: it joins the registry
  EXPECT_FALSE(registry_signature().observed);
  EXPECT_EQ(st.amax_history()[0][0].item<float>(), 0.0f);
  const at::Tensor x = at::tensor({1.0f, -4.0f});
  st.cast(x, Role::kInput, delayed(), QuantizeOptions{});
  EXPECT_FLOAT_EQ(st.scale()[0].item<float>(), 448.0f / 4.0f);  // the first real cast decides
  EXPECT_TRUE(registry_signature().observed);
}

TEST(Fp8Registry, InferenceCastChangesNothing) {
  ScalingState st;
  const at::Tensor x = at::tensor({2.0f, -8.0f});
  {
    c10::InferenceMode guard;
    const Quantized q = st.cast(x, Role::kInput, delayed(), QuantizeOptions{});
    EXPECT_FLOAT_EQ(q.scale_inv.item<float>(), 8.0f / 448.0f);  // its own amax, not kept
    EXPECT_FALSE(st.allocated());
  }
  st.cast(x, Role::kInput, delayed(), QuantizeOptions{});
  EXPECT_FALSE(st.amax_history().is_inference());
  {
    c10::InferenceMode guard;
    st.cast(x * 10, Role::kInput, delayed(), QuantizeOptions{});  // training's scale, no record
  }
  EXPECT_FLOAT_EQ(st.amax_history()[0][0].item<float>(), 8.0f);
  EXPECT_FLOAT_EQ(st.scale()[0].item<float>(), 448.0f / 8.0f);
}

TEST(Fp8Registry, ReductionIsOrderedByIdentityNotCreation) {
  ScalingState zeta("Z"), alpha("A");
  EXPECT_EQ(alpha.identity().rfind("unnamed #", 0), 0u);
  zeta.set_identity("zeta");
  alpha.set_identity("alpha");
  zeta.cast(at::tensor({2.0f}), Role::kInput, delayed(), QuantizeOptions{});
  alpha.cast(at::tensor({1.0f}), Role::kInput, delayed(), QuantizeOptions{});
  const std::vector<std::string> d = registry_descriptions();
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0], "alpha [E4M3/E5M2 history=4 max margin=0]");
  EXPECT_EQ(d[1], "zeta [E4M3/E5M2 history=4 max margin=0]");
  const at::Tensor amaxes = registry_amaxes();
  EXPECT_EQ(amaxes[0].item<float>(), 1.0f);  // alpha's input first
  EXPECT_EQ(amaxes[3].item<float>(), 2.0f);
  registry_update(amaxes);
}

TEST(Fp8Registry, SignatureChangesOnlyWithTheSet) {
  ScalingState a;
  a.cast(at::tensor({1.0f}), Role::kInput, delayed(), QuantizeOptions{});
  const int64_t h0 = registry_signature().hash;
  EXPECT_GE(h0, 0);
  EXPECT_LT(h0, int64_t{1} << 62);
  a.cast(at::tensor({3.0f}), Role::kInput, delayed(), QuantizeOptions{});
  EXPECT_EQ(registry_signature().hash, h0);
  a.cast(at::tensor({3.0f}), Role::kInput, delayed(4, 1.0f), QuantizeOptions{});
  const int64_t h1 = registry_signature().hash;
  EXPECT_NE(h1, h0);  // another recipe
  int64_t h2 = 0;
  {
    ScalingState b;
    b.cast(at::tensor({1.0f}), Role::kInput, delayed(), QuantizeOptions{});
    h2 = registry_signature().hash;
    EXPECT_NE(h2, h1);
    EXPECT_EQ(registry_signature().size, 2);
  }
  EXPECT_EQ(registry_signature().hash, h1);  // b gone: back to a alone
  a.set_identity("renamed");
  EXPECT_NE(registry_signature().hash, h1);
}

// Recipes without state have their own hash: noted once however many forwards use them, apart
// from the states' hash, listed after the states, and gone after registry_forget_recipes().
TEST(Fp8Registry, StatelessRecipesHaveTheirOwnHash) {
  registry_forget_recipes();
  const RegistrySignature s0 = registry_signature();
  EXPECT_EQ(s0.recipes_hash, -1);
  registry_note_recipe(delayed());  // states describe a delayed recipe: not noted
  EXPECT_EQ(registry_signature().recipes_hash, -1);
  Recipe current;
  current.kind = RecipeKind::kCurrent;
  registry_note_recipe(current);
  const RegistrySignature s1 = registry_signature();
  EXPECT_EQ(s1.hash, s0.hash);  // the states' hash is the states' alone
  EXPECT_GE(s1.recipes_hash, 0);
  EXPECT_LT(s1.recipes_hash, int64_t{1} << 62);
  registry_note_recipe(current);
  EXPECT_EQ(registry_signature().recipes_hash, s1.recipes_hash);
  Recipe margin = current;
  margin.margin = 1.0f;
  registry_note_recipe(margin);
  EXPECT_NE(registry_signature().recipes_hash, s1.recipes_hash);
  Recipe block;
  block.kind = RecipeKind::kBlock;
  block.bwd_format = Format::kE4M3;
  registry_forget_recipes();
  registry_note_recipe(block);
  const std::vector<std::string> d = registry_descriptions();
  ASSERT_FALSE(d.empty());
  EXPECT_EQ(d.back(),
            "recipe without state: Float8BlockScaling E4M3/E4M3 power_2_scale=1,1,1 "
            "amax_epsilon=0,0,0");
  EXPECT_NE(registry_signature().recipes_hash, s1.recipes_hash);
  registry_forget_recipes();
  EXPECT_EQ(registry_signature().recipes_hash, -1);
  EXPECT_EQ(registry_descriptions().size(), d.size() - 1);
}

TEST(Fp8Registry, RestoreRefusesImpossibleScales) {
  ScalingState st;
  st.cast(at::tensor({1.0f}), Role::kInput, delayed(), QuantizeOptions{});
  ScalingState::Snapshot s = st.snapshot();
  for (float bad : {std::nanf(""), -1.0f, 0.0f, std::numeric_limits<float>::infinity()}) {
    ScalingState::Snapshot t = s;
    t.scale = s.scale.clone();
    t.scale[1].fill_(bad);
    EXPECT_THROW(st.restore(t, "fc._extra_state"), ValueError) << bad;
  }
  ScalingState::Snapshot t = s;
  t.amax_history = s.amax_history.clone();
  t.amax_history[0][0].fill_(-1.0f);
  EXPECT_THROW(st.restore(t), ValueError);
  t.amax_history[0][0].fill_(std::nanf(""));  // NaN amaxes are legal (C7 keeps the scale)
  EXPECT_NO_THROW(st.restore(t));
}

// current_scale is compute_scale's rule where the amax lives (one launch on CUDA): every case of
// the rule, bit for bit, including the ones that keep 1 (0, NaN, Inf) and the FLT_MAX clamp.
TEST(CurrentScale, SameRuleAsComputeScale) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  for (float margin : {0.0f, 1.0f, 0.5f}) {
    for (float a : {3.5f, 448.0f, 1e-30f, tiny, 0.0f, std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), 6e4f}) {
      for (Format f : {Format::kE4M3, Format::kE5M2}) {
        const float got = current_scale(at::full({1}, a), f, margin).item<float>();
        const float want = compute_scale(a, fp8_max(f), margin, 1.0f);
        EXPECT_EQ(got, want) << "amax " << a << " margin " << margin;
      }
    }
  }
}

// A delayed cast merges its amax into row 0 of the history inside the cast (amax_slot): the row
// is the max over the step's casts of a role, and the update starts the next step from 0.
TEST(AmaxSlot, RowZeroIsTheMaxOfTheStepsCasts) {
  settle();
  ScalingState st;
  st.cast(at::tensor({1.0f, -3.0f}), Role::kInput, delayed(), QuantizeOptions{});
  st.cast(at::tensor({2.0f, 0.5f}), Role::kInput, delayed(), QuantizeOptions{});
  st.cast(at::tensor({-7.0f}), Role::kGradOutput, delayed(), QuantizeOptions{});
  EXPECT_EQ(st.amax_history()[0][0].item<float>(), 3.0f);
  EXPECT_EQ(st.amax_history()[0][1].item<float>(), 0.0f);  // no weight cast
  EXPECT_EQ(st.amax_history()[0][2].item<float>(), 7.0f);
  const Quantized q = st.cast(at::tensor({5.0f}), Role::kInput, delayed(), QuantizeOptions{});
  EXPECT_EQ(q.amax.data_ptr(), st.amax_history()[0][0].data_ptr());  // the slot itself
  EXPECT_EQ(st.amax_history()[0][0].item<float>(), 5.0f);
  registry_update(registry_amaxes());
  EXPECT_EQ(st.amax_history()[0][0].item<float>(), 0.0f);  // rolled: row 1 holds 5
  EXPECT_EQ(st.amax_history()[1][0].item<float>(), 5.0f);
}

// fp8_max is written when the state is made and when the recipe's formats change, not on every
// cast (it was three launches per cast); a format change must still reach it.
TEST(AmaxSlot, FormatChangeRewritesFp8Max) {
  ScalingState st;
  Recipe r = delayed();
  r.fwd_format = Format::kE4M3;
  r.bwd_format = Format::kE5M2;
  st.cast(at::tensor({1.0f}), Role::kInput, r, QuantizeOptions{});
  EXPECT_EQ(st.update_slot(nullptr).params.fp8_max[0], 448.0f);
  EXPECT_EQ(st.update_slot(nullptr).params.fp8_max[2], 57344.0f);
  r.bwd_format = Format::kE4M3;  // E4M3 everywhere
  st.cast(at::tensor({1.0f}), Role::kGradOutput, r, QuantizeOptions{});
  EXPECT_EQ(st.update_slot(nullptr).params.fp8_max[2], 448.0f);
}

}  // namespace
}  // namespace fp8dp
