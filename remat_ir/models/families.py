"""Small transformers models of the families users train, called as users call them.

``FAMILIES[name](seed)`` returns ``(model, kwargs)``: a model built from a
small config (random weights, nothing downloaded) and the keyword arguments
of a training call (ids, masks, labels), so that ``model(**kwargs).loss`` is
the step's loss.  The tests and ``tools/fidelity.py`` train each through
``remat_ir.wrap`` against eager.  Needs ``transformers`` (and ``peft`` for
``llama-lora``), which the ``test`` extra installs, and ``timm`` for
``convnext`` and ``diffusers`` for ``unet`` (their tests skip without them).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["FAMILIES"]

_VOCAB, _BATCH, _SEQ = 128, 2, 32


def _ids(g: torch.Generator, seq: int = _SEQ) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (_BATCH, seq), generator=g)


def _llama_config(layers: int = 3):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def llama(seed: int = 0, padded: bool = False, use_cache: bool | None = None):
    """A decoder-only LM (Llama) with an attention mask: all ones, or with
    the first row's last 5 positions padded (masked, labels -100).  With
    `use_cache=False` in the call, as training scripts often set it, the
    model does not return its key/value cache."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config())
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if padded:
        mask[0, -5:] = 0
        labels[0, -5:] = -100
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if use_cache is not None:
        kwargs["use_cache"] = use_cache
    return model, kwargs


def llama_lora(seed: int = 0):
    """The Llama above with LoRA adapters (peft) on its attention projections."""
    from peft import LoraConfig, get_peft_model

    model, kwargs = llama(seed)
    torch.manual_seed(seed + 1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                             target_modules=["q_proj", "v_proj"]))
    # peft initializes B to zero; a random B makes the adapters matter in the gradients.
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model, kwargs


def mixtral(seed: int = 0):
    """A mixture of experts (Mixtral: 4 experts, top 2), routing inside the step."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128))
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def qwen3_moe(seed: int = 0):
    """A mixture of experts whose loss adds the router's load-balancing loss
    in place (Qwen3-MoE, `output_router_logits`: `loss += coef * aux_loss`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, output_router_logits=True, router_aux_loss_coef=0.01))
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _padded_lm_call(seed: int) -> dict:
    """A padded batch as a collator gives it: the second row's last 8
    positions masked, their labels -100."""
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g)
    mask = torch.ones_like(ids)
    mask[1, -8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def mistral(seed: int = 0):
    """A decoder-only LM with sliding-window attention (Mistral, window 16 of 32) and a padded mask."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=16))
    return model, _padded_lm_call(seed)


def gemma2(seed: int = 0):
    """Gemma2: logit soft-capping, sliding-window layers alternating with
    global ones, eager attention (as transformers advises for its training), a padded mask."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=16,
        attn_implementation="eager"))
    return model, _padded_lm_call(seed)


def phi3(seed: int = 0):
    """Phi3 with sliding-window attention (window 16 of 32), its fused qkv and
    gate-up projections, and a padded mask."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    model = Phi3ForCausalLM(Phi3Config(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=16, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))
    return model, _padded_lm_call(seed)


def mamba(seed: int = 0, layers: int = 4, seq: int = 16):
    """A state-space LM (Mamba) on transformers' pure-torch path: the
    selective scan's recurrence is a Python loop over the sequence, and each
    layer's backward holds (batch, 2 d, seq, state) tensors whole (the
    discretized A and B, their gradients), which recomputation cannot split:
    with 2 layers (32 tokens) the floor is 66% of the unoptimized peak and a
    budget of 0.5 is refused; 4 layers plan at 0.5."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    model = MambaForCausalLM(MambaConfig(
        vocab_size=_VOCAB, hidden_size=64, state_size=8, num_hidden_layers=layers, expand=2, conv_kernel=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g, seq)
    return model, {"input_ids": ids, "labels": ids.clone()}


def distilbert(seed: int = 0):
    """An encoder classifier (DistilBERT sequence classification, dropout 0.1) with a padded mask."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(seed)
    model = DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=_VOCAB, dim=64, hidden_dim=128, n_layers=2, n_heads=4, max_position_embeddings=128, num_labels=3))
    call = _padded_lm_call(seed)
    return model, {"input_ids": call["input_ids"], "attention_mask": call["attention_mask"],
                   "labels": torch.tensor([0, 2])}


def modernbert(seed: int = 0):
    """A masked LM with local attention layers between global ones (ModernBERT, window 16) and a padded mask."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    torch.manual_seed(seed)
    model = ModernBertForMaskedLM(ModernBertConfig(
        vocab_size=_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=128, global_attn_every_n_layers=2, local_attention=16, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))
    return model, _padded_lm_call(seed)


def _seq2seq_call(seed: int) -> dict:
    """An encoder-decoder's training call: ids, a mask with the second row's
    last 4 positions padded, and labels half as long."""
    g = torch.Generator().manual_seed(seed)
    ids = _ids(g)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": _ids(g, _SEQ // 2)}


def t5(seed: int = 0):
    """An encoder-decoder (T5, dropout 0.1) with a padded encoder mask and labels."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(
        vocab_size=_VOCAB, d_model=64, d_ff=128, d_kv=16, num_layers=1, num_decoder_layers=1, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0))
    return model, _seq2seq_call(seed)


def bart(seed: int = 0):
    """An encoder-decoder (BART, dropout 0.1) with a padded encoder mask and labels."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    model = BartForConditionalGeneration(BartConfig(
        vocab_size=_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))
    return model, _seq2seq_call(seed)


def t5_nomask(seed: int = 0):
    """The T5 above called without an attention mask (ids and labels only)."""
    model, call = t5(seed)
    return model, {"input_ids": call["input_ids"], "labels": call["labels"]}


def bart_nomask(seed: int = 0):
    """The BART above called without an attention mask (ids and labels only)."""
    model, call = bart(seed)
    return model, {"input_ids": call["input_ids"], "labels": call["labels"]}


def whisper(seed: int = 0):
    """A speech encoder-decoder (Whisper, dropout 0.1) on 24 mel bins x 64
    frames, with labels whose second row's last 4 positions are padding
    (-100), as a speech collator gives them: the model shifts them right
    into its decoder inputs."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=_VOCAB, num_mel_bins=24, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_source_positions=32, max_target_positions=64, dropout=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1, begin_suppress_tokens=None))
    g = torch.Generator().manual_seed(seed)
    labels = _ids(g, _SEQ // 2)
    labels[1, -4:] = -100
    return model, {"input_features": torch.randn(_BATCH, 24, 64, generator=g), "labels": labels}


def vit(seed: int = 0):
    """A vision transformer classifier (ViT) on 32 x 32 images."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    model = ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=128, num_labels=10, hidden_dropout_prob=0.1))
    g = torch.Generator().manual_seed(seed)
    return model, {"pixel_values": torch.randn(_BATCH, 3, 32, 32, generator=g),
                   "labels": torch.randint(0, 10, (_BATCH,), generator=g)}


def clip(seed: int = 0):
    """A contrastive image-text model (CLIP: two 2-layer towers on 32 x 32
    images and 16-token texts), called with return_loss=True: its loss sums
    over the logits with the learned `logit_scale`."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(seed)
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=_SEQ, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (3, 16), generator=g)
    ids[:, -1] = 2  # the text tower pools at the end-of-text token
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "pixel_values": torch.randn(3, 3, 32, 32, generator=g), "return_loss": True}


class _Classifier(torch.nn.Module):
    """An image classifier that returns logits (timm's), called as
    transformers' are: `model(pixel_values=..., labels=...).loss`."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pixel_values, labels=None):
        from transformers.modeling_outputs import ImageClassifierOutput

        logits = self.net(pixel_values)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return ImageClassifierOutput(loss=loss, logits=logits)


def convnext(seed: int = 0):
    """A convolutional classifier (timm's ConvNeXt-atto, 16 to 64 channels,
    stochastic depth 0.1) on 32 x 32 images: its last stage runs at 1 x 1,
    where NCHW and channels-last strides coincide and eager's kernels, not
    the trace's, pick the layout that its pooling head branches on.  Needs
    `timm` (which imports torchvision)."""
    import timm

    torch.manual_seed(seed)
    net = timm.create_model("convnext_atto", pretrained=False, num_classes=10, dims=(16, 32, 48, 64),
                            drop_path_rate=0.1)
    g = torch.Generator().manual_seed(seed)
    return _Classifier(net), {"pixel_values": torch.randn(_BATCH, 3, 32, 32, generator=g),
                              "labels": torch.randint(0, 10, (_BATCH,), generator=g)}


class _NoisePredictor(torch.nn.Module):
    """A diffusion model's training step as diffusers' training scripts write
    it: the UNet predicts the noise of a noisy latent at a timestep, given
    the text encoder's states, and the loss is the mean squared error
    against the noise; called as transformers models are (`.loss`)."""

    def __init__(self, unet: torch.nn.Module):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, encoder_hidden_states, target):
        from transformers.modeling_outputs import ModelOutput

        pred = self.unet(sample, timestep, encoder_hidden_states).sample
        loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
        return ModelOutput(loss=loss, sample=pred)


def unet(seed: int = 0):
    """A diffusers UNet2DConditionModel (32 and 64 channels, a cross-attention
    block down and up, 16 x 16 latents of 4 channels, 8 text states of 32)
    trained to predict the noise (DDPM's noising of random latents at random
    timesteps).  Needs `diffusers`."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    torch.manual_seed(seed)
    net = UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(_BATCH, 4, 16, 16, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    timesteps = torch.randint(0, 1000, (_BATCH,), generator=g)
    noisy = DDPMScheduler(num_train_timesteps=1000).add_noise(latents, noise, timesteps)
    return _NoisePredictor(net), {"sample": noisy, "timestep": timesteps,
                                  "encoder_hidden_states": torch.randn(_BATCH, 8, 32, generator=g),
                                  "target": noise}


FAMILIES: dict[str, Callable] = {
    "llama": llama,
    "llama-padded": lambda seed=0: llama(seed, padded=True),
    "llama-nocache": lambda seed=0: llama(seed, use_cache=False),
    "llama-lora": llama_lora,
    "mixtral": mixtral,
    "qwen3-moe": qwen3_moe,
    "mistral": mistral,
    "gemma2": gemma2,
    "phi3": phi3,
    "mamba": mamba,
    "distilbert": distilbert,
    "modernbert": modernbert,
    "t5": t5,
    "bart": bart,
    "t5-nomask": t5_nomask,
    "bart-nomask": bart_nomask,
    "whisper": whisper,
    "vit": vit,
    "clip": clip,
    "convnext": convnext,
    "unet": unet,
}
