"""TransformerLens's Main Demo and Exploratory Analysis Demo, written as a TransformerLens user writes them, with
`transformer_lens` replaced by `moelens` and nothing else changed but the model and its prompts: gpt2-small
becomes the embedded tiny-code-moe (a mixture-of-experts model of Python code), and the prompts are code whose
answers are single tokens of its vocabulary. The notebooks' plots (plotly, circuitsvis) are printed numbers
here; their sanity checks are asserts. Run: `python docs/tl_notebook.py` (CI runs it: tests/test_tl_notebook.py).
"""

from functools import partial

import einops
import torch
import torch.nn as nn
from jaxtyping import Float

import moelens as tl  # was: import transformer_lens as tl
import moelens.utils as utils  # was: import transformer_lens.utils as utils
from moelens import ActivationCache, FactoredMatrix, HookedTransformer, HookedTransformerConfig, patching
from moelens.hook_points import HookedRootModule, HookPoint

torch.set_grad_enabled(False)
device = utils.get_device()
model = HookedTransformer.from_pretrained("tiny-code-moe", device=device)
assert isinstance(model, tl.HookedTransformer) and isinstance(model.cfg, HookedTransformerConfig)
print(model.cfg.n_layers, model.cfg.d_model, model.cfg.n_heads, model.cfg.d_vocab)

# ---- Main Demo: loading and running models ---------------------------------------------------------------------
model_description_text = '''def fib(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
'''
loss = model(model_description_text, return_type="loss")
print("Model loss:", loss)
assert 0 < loss.item() < 10

# ---- Caching all activations -----------------------------------------------------------------------------------
gpt2_text = "import os\n\ndef list_files(path):\n    for name in os.listdir(path):\n        print(name)\n"
gpt2_tokens = model.to_tokens(gpt2_text)
print(gpt2_tokens.device)
gpt2_logits, gpt2_cache = model.run_with_cache(gpt2_tokens, remove_batch_dim=True)
print(type(gpt2_cache))
attention_pattern = gpt2_cache["pattern", 0, "attn"]
print(attention_pattern.shape)
gpt2_str_tokens = model.to_str_tokens(gpt2_text)
assert isinstance(gpt2_cache, ActivationCache)
assert attention_pattern.shape == (model.cfg.n_heads, len(gpt2_str_tokens), len(gpt2_str_tokens))
torch.testing.assert_close(attention_pattern.sum(-1), torch.ones(model.cfg.n_heads, len(gpt2_str_tokens)))

# ---- Hooks: intervening on activations -----------------------------------------------------------------------
layer_to_ablate = 0
head_index_to_ablate = 1  # gpt2-small's 8: this model's hook_v has its 2 key-value heads


def head_ablation_hook(
    value: Float[torch.Tensor, "batch pos head_index d_head"], hook: HookPoint
) -> Float[torch.Tensor, "batch pos head_index d_head"]:
    print(f"Shape of the value tensor: {value.shape}")
    value[:, :, head_index_to_ablate, :] = 0.0
    return value


original_loss = model(gpt2_tokens, return_type="loss")
ablated_loss = model.run_with_hooks(
    gpt2_tokens, return_type="loss", fwd_hooks=[(utils.get_act_name("v", layer_to_ablate), head_ablation_hook)]
)
print(f"Original Loss: {original_loss.item():.3f}")
print(f"Ablated Loss: {ablated_loss.item():.3f}")
assert ablated_loss.item() != original_loss.item()

# ---- Activation patching on the residual stream -------------------------------------------------------------
clean_prompt = "for name in data:\n    print("
corrupted_prompt = "for line in data:\n    print("


def logits_to_logit_diff(logits, correct_answer="name", incorrect_answer="line"):
    # model.to_single_token maps a string value of a single token to the token index for that token
    # If the string is not a single token, it raises an error.
    correct_index = model.to_single_token(correct_answer)
    incorrect_index = model.to_single_token(incorrect_answer)
    return logits[0, -1, correct_index] - logits[0, -1, incorrect_index]


clean_tokens = model.to_tokens(clean_prompt)
corrupted_tokens = model.to_tokens(corrupted_prompt)
clean_logits, clean_cache = model.run_with_cache(clean_tokens)
clean_logit_diff = logits_to_logit_diff(clean_logits)
print(f"Clean logit difference: {clean_logit_diff.item():.3f}")
corrupted_logits = model(corrupted_tokens)
corrupted_logit_diff = logits_to_logit_diff(corrupted_logits)
print(f"Corrupted logit difference: {corrupted_logit_diff.item():.3f}")


def residual_stream_patching_hook(
    resid_pre: Float[torch.Tensor, "batch pos d_model"], hook: HookPoint, position: int
) -> Float[torch.Tensor, "batch pos d_model"]:
    # Each HookPoint has a name attribute giving the name of the hook.
    clean_resid_pre = clean_cache[hook.name]
    resid_pre[:, position, :] = clean_resid_pre[:, position, :]
    return resid_pre


num_positions = len(clean_tokens[0])
ioi_patching_result = torch.zeros((model.cfg.n_layers, num_positions), device=model.cfg.device)
for layer in range(model.cfg.n_layers):
    for position in range(num_positions):
        temp_hook_fn = partial(residual_stream_patching_hook, position=position)
        patched_logits = model.run_with_hooks(
            corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), temp_hook_fn)]
        )
        patched_logit_diff = logits_to_logit_diff(patched_logits).detach()
        ioi_patching_result[layer, position] = (patched_logit_diff - corrupted_logit_diff) / (
            clean_logit_diff - corrupted_logit_diff
        )
print(ioi_patching_result)
# the prompts differ at one token: patching it in the embedding restores the clean run, and patching a position
# before it changes nothing but rounding (the two runs' grouped expert GEMMs hold other rows after that token,
# which can round an earlier row's last bit differently: measured 3e-7 of the logit difference)
differ = int((clean_tokens != corrupted_tokens).nonzero()[0, 1])
torch.testing.assert_close(ioi_patching_result[0, differ], torch.tensor(1.0), atol=1e-4, rtol=0)
assert torch.all(ioi_patching_result[0, :differ] == 0)  # the embeddings of equal tokens are equal
assert torch.all(ioi_patching_result[:, :differ].abs() <= 1e-5)


# ---- Hooks: accessing activations (induction heads) ---------------------------------------------------------
batch_size = 4  # the demo's 10 and 50: a smaller batch keeps this quick on a CPU
seq_len = 20
size = (batch_size, seq_len)
input_tensor = torch.randint(100, model.cfg.d_vocab, size)  # gpt2-small's (1000, 10000)
random_tokens = input_tensor.to(model.cfg.device)
repeated_tokens = einops.repeat(random_tokens, "batch seq_len -> batch (2 seq_len)")
repeated_logits = model(repeated_tokens)
correct_log_probs = model.loss_fn(repeated_logits, repeated_tokens, per_token=True)
loss_by_position = einops.reduce(correct_log_probs, "batch position -> position", "mean")
print("Loss on the first half:", loss_by_position[: seq_len - 1].mean().item())
print("Loss on the repeated half:", loss_by_position[seq_len:].mean().item())

induction_score_store = torch.zeros((model.cfg.n_layers, model.cfg.n_heads), device=model.cfg.device)


def induction_score_hook(pattern: Float[torch.Tensor, "batch head_index dest_pos source_pos"], hook: HookPoint):
    # We take the diagonal of attention paid from each destination position to source positions seq_len-1 tokens back
    # (This only has entries for tokens with index>=seq_len)
    induction_stripe = pattern.diagonal(dim1=-2, dim2=-1, offset=1 - seq_len)
    # Get an average score per head
    induction_score = einops.reduce(induction_stripe, "batch head_index position -> head_index", "mean")
    # Store the result.
    induction_score_store[hook.layer(), :] = induction_score


# We make a boolean filter on activation names, that's true only on attention pattern names.
pattern_hook_names_filter = lambda name: name.endswith("pattern")  # noqa: E731

model.run_with_hooks(repeated_tokens, return_type=None, fwd_hooks=[(pattern_hook_names_filter, induction_score_hook)])
print(induction_score_store)
assert induction_score_store.shape == (model.cfg.n_layers, model.cfg.n_heads)
assert bool((induction_score_store >= 0).all() and (induction_score_store <= 1).all())
assert bool((induction_score_store > 0).any())

# ---- HookedRootModule: hooks in a model of your own -----------------------------------------------------------
class SquareThenAdd(nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.offset = nn.Parameter(torch.tensor(offset))
        self.hook_square = HookPoint()

    def forward(self, x):
        # The hook_square doesn't change the value, but lets us access it
        square = self.hook_square(x * x)
        return self.offset + square


class TwoLayerModel(HookedRootModule):
    def __init__(self):
        super().__init__()
        self.layer1 = SquareThenAdd(3.0)
        self.layer2 = SquareThenAdd(-4.0)
        self.hook_in = HookPoint()
        self.hook_mid = HookPoint()
        self.hook_out = HookPoint()

        # We need to call the setup function of HookedRootModule to build an
        # internal dictionary of modules and hooks, and to give each hook a name
        super().setup()

    def forward(self, x):
        # We wrap the input and each layer's output in a hook - they leave the
        # value unchanged (unless there's an intervention hook added to that point)
        x_in = self.hook_in(x)
        x_mid = self.hook_mid(self.layer1(x_in))
        x_out = self.hook_out(self.layer2(x_mid))
        return x_out


toy_model = TwoLayerModel()
out, cache = toy_model.run_with_cache(torch.tensor(5.0))
print("Model output:", out.item())
for key in cache:
    print(f"{key}: {cache[key]}")
assert out.item() == (5.0**2 + 3) ** 2 - 4 and isinstance(cache, ActivationCache)
assert {key: cache[key].item() for key in cache} == {
    "layer1.hook_square": 25.0, "layer2.hook_square": 784.0, "hook_in": 5.0, "hook_mid": 28.0, "hook_out": 780.0,
}


def set_to_zero_hook(tensor, hook):
    print(hook.name)
    return torch.tensor(0.0)


intervened = toy_model.run_with_hooks(torch.tensor(5.0), fwd_hooks=[("layer2.hook_square", set_to_zero_hook)])
print("Output after intervening on layer2.hook_scaled", intervened.item())
assert intervened.item() == -4.0

# ---- FactoredMatrix ------------------------------------------------------------------------------------------------
A = torch.randn(5, 2)
B = torch.randn(2, 5)
AB = A @ B
AB_factor = FactoredMatrix(A, B)
print("Norms:")
print(AB.norm())
print(AB_factor.norm())
torch.testing.assert_close(AB_factor.norm(), AB.norm())
print(f"Right dimension: {AB_factor.rdim}, Left dimension: {AB_factor.ldim}, Hidden dimension: {AB_factor.mdim}")
assert (AB_factor.ldim, AB_factor.rdim, AB_factor.mdim) == (5, 5, 2)
print("Eigenvalues:")
print(torch.linalg.eig(AB).eigenvalues)
print(AB_factor.eigenvalues)
print("Singular Values:")
print(torch.linalg.svd(AB).S)
print(AB_factor.S)
torch.testing.assert_close(AB_factor.S, torch.linalg.svd(AB).S[:2])
print("Full SVD:")
U, S, V = AB_factor.svd()
torch.testing.assert_close(U @ torch.diag(S) @ V.T, AB, atol=1e-5, rtol=1e-4)
C = torch.randn(5, 300)
ABC = AB @ C
ABC_factor = AB_factor @ C
print("Unfactored:", ABC.shape, ABC.norm())
print("Factored:", ABC_factor.shape, ABC_factor.norm())
print(f"Right dimension: {ABC_factor.rdim}, Left dimension: {ABC_factor.ldim}, Hidden dimension: {ABC_factor.mdim}")
torch.testing.assert_close(ABC_factor.norm(), ABC.norm(), rtol=1e-4, atol=1e-4)
AB_unfactored = AB_factor.AB
assert torch.isclose(AB_unfactored, AB).all()

# ---- Looking at the OV circuit -----------------------------------------------------------------------------------
OV_circuit_all_heads = model.OV
print(OV_circuit_all_heads)
OV_circuit_all_heads_eigenvalues = OV_circuit_all_heads.eigenvalues
print(OV_circuit_all_heads_eigenvalues.shape)
print(OV_circuit_all_heads_eigenvalues.dtype)
OV_copying_score = OV_circuit_all_heads_eigenvalues.sum(dim=-1).real / OV_circuit_all_heads_eigenvalues.abs().sum(dim=-1)
print(utils.to_numpy(OV_copying_score))
assert OV_copying_score.shape == (model.cfg.n_layers, model.cfg.n_heads)

full_OV_circuit = model.embed.W_E @ OV_circuit_all_heads @ model.unembed.W_U
print(full_OV_circuit)
full_OV_circuit_eigenvalues = full_OV_circuit.eigenvalues
full_OV_copying_score = full_OV_circuit_eigenvalues.sum(dim=-1).real / full_OV_circuit_eigenvalues.abs().sum(dim=-1)
print(utils.to_numpy(full_OV_copying_score))
layer, head_index = 1, 0
corner = utils.get_corner(full_OV_circuit[layer, head_index], n=3)
torch.testing.assert_close(
    corner, (model.W_E[:3] @ OV_circuit_all_heads[layer, head_index].AB @ model.W_U[:, :3]), atol=1e-4, rtol=1e-4
)


def top_1_acc(full_OV_circuit: FactoredMatrix, batch_size: int = 1000) -> float:
    """The share of tokens whose own unembedding gets the largest logit through this head's OV circuit."""
    total = 0
    for indices in torch.split(torch.arange(full_OV_circuit.shape[-2]), batch_size):
        AB_slice = full_OV_circuit[indices].AB
        total += (torch.argmax(AB_slice, dim=1) == indices).float().sum().item()
    return total / full_OV_circuit.shape[-2]


print(f"Top-1 accuracy of the full OV circuit of L{layer}H{head_index}:", top_1_acc(full_OV_circuit[layer, head_index]))

# ---- Exploratory Analysis Demo: direct logit attribution on an indirect-object-like task --------------------
pairs = [("name", "data"), ("line", "file"), ("key", "value"), ("path", "text")]
prompt_format = "for {} in {}:\n    print("
prompts, answers = [], []
for x, y in pairs:
    prompts += [prompt_format.format(x, y), prompt_format.format(y, x)]
    answers += [(x, y), (y, x)]  # (correct: the loop variable, incorrect: the iterable)
answer_tokens = torch.tensor([[model.to_single_token(answer) for answer in pair] for pair in answers], device=model.cfg.device)
tokens = model.to_tokens(prompts, prepend_bos=True)
assert (tokens != model.tokenizer.pad_token_id).all(), "equal lengths: the last position is every prompt's last token"
original_logits, cache = model.run_with_cache(tokens)


def logits_to_ave_logit_diff(logits, answer_tokens, per_prompt=False):
    # Only the final logits are relevant for the answer
    final_logits = logits[:, -1, :]
    answer_logits = final_logits.gather(dim=-1, index=answer_tokens)
    answer_logit_diff = answer_logits[:, 0] - answer_logits[:, 1]
    if per_prompt:
        return answer_logit_diff
    else:
        return answer_logit_diff.mean()


print("Per prompt logit difference:", logits_to_ave_logit_diff(original_logits, answer_tokens, per_prompt=True))
original_average_logit_diff = logits_to_ave_logit_diff(original_logits, answer_tokens)
print("Average logit difference:", original_average_logit_diff.item())

answer_residual_directions = model.tokens_to_residual_directions(answer_tokens)
print("Answer residual directions shape:", answer_residual_directions.shape)
logit_diff_directions = answer_residual_directions[:, 0] - answer_residual_directions[:, 1]
final_residual_stream = cache["resid_post", -1]
print("Final residual stream shape:", final_residual_stream.shape)
final_token_residual_stream = final_residual_stream[:, -1, :]
# Apply LayerNorm scaling
# pos_slice is the subset of the positions we take - here the final token of each prompt
scaled_final_token_residual_stream = cache.apply_ln_to_stack(final_token_residual_stream, layer=-1, pos_slice=-1)
average_logit_diff = (
    torch.einsum("bd,bd->", scaled_final_token_residual_stream, logit_diff_directions) / len(prompts)
)
print("Calculated average logit diff:", average_logit_diff.item())
print("Original logit difference:", original_average_logit_diff.item())
torch.testing.assert_close(average_logit_diff, original_average_logit_diff, atol=1e-4, rtol=1e-4)


def residual_stack_to_logit_diff(residual_stack: Float[torch.Tensor, "components batch d_model"], cache: ActivationCache):
    scaled_residual_stack = cache.apply_ln_to_stack(residual_stack, layer=-1, pos_slice=-1)
    return torch.einsum("...bd,bd->...", scaled_residual_stack, logit_diff_directions) / len(prompts)


# logit lens
accumulated_residual, labels = cache.accumulated_resid(layer=-1, incl_mid=True, pos_slice=-1, return_labels=True)
logit_lens_logit_diffs = residual_stack_to_logit_diff(accumulated_residual, cache)
print(dict(zip(labels, logit_lens_logit_diffs.tolist())))
torch.testing.assert_close(logit_lens_logit_diffs[-1], original_average_logit_diff, atol=1e-4, rtol=1e-4)

# layer attribution
per_layer_residual, labels = cache.decompose_resid(layer=-1, pos_slice=-1, return_labels=True)
per_layer_logit_diffs = residual_stack_to_logit_diff(per_layer_residual, cache)
print(dict(zip(labels, per_layer_logit_diffs.tolist())))
torch.testing.assert_close(per_layer_logit_diffs.sum(), original_average_logit_diff, atol=1e-4, rtol=1e-4)

# head attribution
per_head_residual, labels = cache.stack_head_results(layer=-1, pos_slice=-1, return_labels=True)
per_head_logit_diffs = residual_stack_to_logit_diff(per_head_residual, cache)
per_head_logit_diffs = einops.rearrange(
    per_head_logit_diffs, "(layer head_index) -> layer head_index", layer=model.cfg.n_layers, head_index=model.cfg.n_heads
)
print(per_head_logit_diffs)
per_layer_attn = torch.stack([residual_stack_to_logit_diff(cache["attn_out", l][None, :, -1], cache)[0] for l in range(model.cfg.n_layers)])
torch.testing.assert_close(per_head_logit_diffs.sum(-1), per_layer_attn, atol=1e-4, rtol=1e-4)  # no o_proj bias here

# attention patterns of the top heads
top_k = 3
top_heads = torch.topk(per_head_logit_diffs.flatten().abs(), k=top_k).indices
for index in top_heads.tolist():
    layer, head = divmod(index, model.cfg.n_heads)
    pattern = cache["pattern", layer][0, head]
    print(f"L{layer}H{head}: attention from the last token", pattern[-1].tolist())

# ---- Activation patching, with the patching helpers -----------------------------------------------------------
corrupted_prompts = [prompts[i + 1] if i % 2 == 0 else prompts[i - 1] for i in range(len(prompts))]
corrupted_tokens = model.to_tokens(corrupted_prompts, prepend_bos=True)
corrupted_logits, corrupted_cache = model.run_with_cache(corrupted_tokens)
corrupted_average_logit_diff = logits_to_ave_logit_diff(corrupted_logits, answer_tokens)
print("Corrupted Average Logit Diff", corrupted_average_logit_diff.item())
print("Clean Average Logit Diff", original_average_logit_diff.item())


def ioi_metric(logits, answer_tokens=answer_tokens):
    return (logits_to_ave_logit_diff(logits, answer_tokens) - corrupted_average_logit_diff) / (
        original_average_logit_diff - corrupted_average_logit_diff
    )


def patch_residual_component(
    corrupted_residual_component: Float[torch.Tensor, "batch pos d_model"], hook, pos, clean_cache
):
    corrupted_residual_component[:, pos, :] = clean_cache[hook.name][:, pos, :]
    return corrupted_residual_component


patched_residual_stream_diff = torch.zeros(model.cfg.n_layers, tokens.shape[1], device=model.cfg.device)
for layer in range(model.cfg.n_layers):
    for position in range(tokens.shape[1]):
        hook_fn = partial(patch_residual_component, pos=position, clean_cache=cache)
        patched_logits = model.run_with_hooks(
            corrupted_tokens, fwd_hooks=[(utils.get_act_name("resid_pre", layer), hook_fn)], return_type="logits"
        )
        patched_residual_stream_diff[layer, position] = ioi_metric(patched_logits)
resid_pre_patching = patching.get_act_patch_resid_pre(model, corrupted_tokens, cache, ioi_metric)
torch.testing.assert_close(resid_pre_patching, patched_residual_stream_diff, atol=1e-5, rtol=1e-5)
# the prompts agree up to their loop variable (BOS, "for"): patching those positions changes nothing
assert torch.all(patched_residual_stream_diff[:, :2] == 0)



def patch_head_vector(
    corrupted_head_vector: Float[torch.Tensor, "batch pos head_index d_head"], hook, head_index, clean_cache
):
    corrupted_head_vector[:, :, head_index, :] = clean_cache[hook.name][:, :, head_index, :]
    return corrupted_head_vector


patched_head_z_diff = torch.zeros(model.cfg.n_layers, model.cfg.n_heads, device=model.cfg.device)
for layer in range(model.cfg.n_layers):
    for head_index in range(model.cfg.n_heads):
        hook_fn = partial(patch_head_vector, head_index=head_index, clean_cache=cache)
        patched_logits = model.run_with_hooks(
            corrupted_tokens, fwd_hooks=[(utils.get_act_name("z", layer, "attn"), hook_fn)], return_type="logits"
        )
        patched_head_z_diff[layer, head_index] = ioi_metric(patched_logits)
head_out_patching = patching.get_act_patch_attn_head_out_all_pos(model, corrupted_tokens, cache, ioi_metric)
torch.testing.assert_close(head_out_patching, patched_head_z_diff, atol=1e-5, rtol=1e-5)

# ---- utils.test_prompt -----------------------------------------------------------------------------------------
example_prompt = "def add(a, b):\n    return a +"
example_answer = " b"
utils.test_prompt(example_prompt, example_answer, model, prepend_bos=True)

print("The TransformerLens notebook ran on moelens.")
