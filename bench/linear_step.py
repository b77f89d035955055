"""One training step of a Linear layer, shared by the CPU and GPU Linear benchmarks."""

import fp8dp


def make_step(module, x, dy, recipe, update_scales=False):
    """A closure running forward (under fp8_autocast when `recipe` is given) and backward with the
    fixed grad_output `dy`, then dropping the gradients; with update_scales, also the per-step
    FP8 scale update, as a training loop does after its optimizer step."""

    def step():
        xa = x.detach().requires_grad_(True)
        if recipe is None:
            y = module(xa)
        else:
            with fp8dp.fp8_autocast(fp8_recipe=recipe):
                y = module(xa)
        y.backward(dy)
        module.zero_grad(set_to_none=True)
        if update_scales and recipe is not None:
            fp8dp.update_fp8_scales()

    return step
