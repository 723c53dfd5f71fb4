"""Hugging Face models built from their configs (a tied head, RoPE attention with grouped KV
heads, an encoder) train under ZeroOptimizer with the default unit choice as under
torch.optim.AdamW. Runs where `transformers` is installed (scripts/python_test.sh installs it
beside the current torch from PyPI)."""

import copy
import inspect

import pytest
import torch

import zeroshard as zs
import zeroshard.torch as zt
from zs_testutil import needs_compile

tf = pytest.importorskip("transformers")

# Three steps at lr 1e-2 on float32: the two sides sum the same gradients in another order (a
# tied weight's two uses, the rank mean), a few ulps per step that the next steps carry on.
BOUND = 1e-4


def build(name):
    """The model `name` from a small config, seeded alike on every call, in training mode."""
    torch.manual_seed(0)
    return _from_config(name).train()


def _from_config(name):
    small = dict(vocab_size=64, max_position_embeddings=32)
    if name == "gpt2":  # its head is tied to the token embedding
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32,
                                                vocab_size=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=2, hidden_size=32,
                                                  intermediate_size=64, num_attention_heads=2,
                                                  num_key_value_heads=1, **small))
    if name == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(num_hidden_layers=2, hidden_size=32,
                                                  intermediate_size=64, num_attention_heads=2,
                                                  num_key_value_heads=1, head_dim=16, **small))
    return tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=32,
                                            intermediate_size=64, num_attention_heads=2,
                                            hidden_dropout_prob=0.0,
                                            attention_probs_dropout_prob=0.0, **small))


def assert_close(got, want):
    """Every floating-point tensor of state dict `got` within BOUND of `want`'s."""
    for k, w in want.items():
        if w.is_floating_point():
            assert (got[k] - w).abs().max().item() <= BOUND, k


def train(model, opt, steps):
    """`steps` steps of language modelling on random tokens, the same ones on every call."""
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "bert"])
def test_model_from_config_trains_as_with_adamw(name, stage):
    model = build(name)
    ref = copy.deepcopy(model)
    init = copy.deepcopy(model.state_dict())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = zt.ZeroOptimizer(model, stage=stage, lr=1e-2, comm=zs.make_self_communicator())
    train(ref, ropt, 3)
    train(model, opt, 3)
    got, want = opt.model_state_dict(), ref.state_dict()
    assert_close(got, want)
    moved = max((got[k] - init[k]).abs().max().item() for k in want if want[k].is_floating_point())
    assert moved > 100 * BOUND
    opt.close()


@needs_compile
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "bert"])
def test_compiled_modules_train_and_generate_as_eager(name, stage):
    # compile_modules(): at stage 3 with a unit per block (unit_numel below a block's size), the
    # way a large model is split, each block, the embeddings and the head (tied to the embedding
    # in GPT-2 and BERT) compiled whole (fullgraph); at stage 0 the model's forward. Training
    # gives eager's weights, and generate() on a left-padded prompt (which reads forward's
    # signature, and calls the blocks with a cache and a new shape each token) eager's tokens.
    from torch._dynamo.utils import counters
    model = build(name)
    ref = copy.deepcopy(model)
    prompt = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    prompt[0, :2], mask[0, :2] = 0, 0
    results, generated = [], []
    for m in (ref, model):
        opt = zt.ZeroOptimizer(m, stage=stage, lr=1e-2, unit_numel=16384,
                               comm=zs.make_self_communicator())
        if m is model:
            torch._dynamo.reset()
            counters.clear()
            names = opt.compile_modules(backend="aot_eager")
            blocks = [n for n in names if n.endswith((".h.0", ".layers.0", ".layer.0"))]
            assert names == [""] if stage < 3 else len(opt.units) >= 4 and blocks, names
            assert all("forward" in m.get_submodule(n).__dict__ for n in names)
            assert inspect.signature(m.forward) == inspect.signature(ref.forward)
        train(m, opt, 3)
        if name != "bert":
            m.eval()
            with torch.no_grad():
                generated.append(m.generate(prompt, attention_mask=mask, max_new_tokens=4,
                                            do_sample=False, pad_token_id=0))
        results.append(opt.model_state_dict())
        opt.close()
    assert_close(results[1], results[0])
    if generated:
        assert generated[0].shape == (2, 10) and torch.equal(generated[0], generated[1])
    if stage == 3:  # at stage 0 the model's own code may break the graph (GPT-2's loss logs)
        assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])  # ran compiled


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_export_loads_with_from_pretrained(name, tmp_path):
    # A trained model's checkpoint, exported in shards, with the config the user adds: the
    # model from_pretrained() builds holds the trained weights and computes the same logits.
    model = build(name)
    opt = zt.ZeroOptimizer(model, stage=3, lr=1e-2, comm=zs.make_self_communicator())
    train(model, opt, 2)
    tag = opt.save_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "hf"
    zs.export_checkpoint(tag, out, max_shard_bytes=64 << 10)
    assert (out / "model.safetensors.index.json").exists()
    model.config.save_pretrained(out)
    loaded = type(model).from_pretrained(out).eval()
    want = opt.model_state_dict()
    have = loaded.state_dict()
    for k, w in want.items():
        assert torch.equal(have[k], w.to(have[k].dtype)), k
    model.eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
