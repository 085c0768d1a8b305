"""Gradient shape sets of real models, written out by hand (no torchvision or transformers
needed): what a codec benchmark must run on, since costs depend on the mix of a few huge
matrices, many small ones and 1-D vectors that travel dense.

Each set is a list of (parameter name, shape) in ``named_parameters()`` order:

* ``resnet50``: torchvision's ResNet-50 (Bottleneck, layers 3-4-6-3, 1000 classes):
  25,557,032 parameters.
* ``bert-base``: Hugging Face ``BertModel`` (bert-base-uncased: vocabulary 30522, 512
  positions, 2 token types, 12 layers, hidden 768, FFN 3072, separate q/k/v, pooler):
  109,482,240 parameters.
* ``transformer-xl``: the WikiText-103 base model of Dai et al. (2019) as in NVIDIA's
  reference: 16 layers, d_model 410, 10 heads of 41, d_inner 2100, fused q/k/v without bias,
  untied relative-position biases, vocabulary 267,735 in an adaptive embedding with cutoffs
  20000/40000/200000 and div_val 1 (so no projections), output softmax tied to the
  embedding (only its biases and cluster parameters are extra): 151,119,838 parameters.
* ``tiny``: a few small tensors, for the smoke test.
"""

import math


def resnet50():
    shapes = [("conv1.weight", (64, 3, 7, 7))] + _norm("bn1", 64)
    inplanes = 64
    for stage, (planes, blocks) in enumerate(zip([64, 128, 256, 512], [3, 4, 6, 3]), start=1):
        for block in range(blocks):
            prefix = f"layer{stage}.{block}"
            shapes += [(f"{prefix}.conv1.weight", (planes, inplanes, 1, 1))] + _norm(f"{prefix}.bn1", planes)
            shapes += [(f"{prefix}.conv2.weight", (planes, planes, 3, 3))] + _norm(f"{prefix}.bn2", planes)
            shapes += [(f"{prefix}.conv3.weight", (4 * planes, planes, 1, 1))]
            shapes += _norm(f"{prefix}.bn3", 4 * planes)
            if block == 0:
                shapes += [(f"{prefix}.downsample.0.weight", (4 * planes, inplanes, 1, 1))]
                shapes += _norm(f"{prefix}.downsample.1", 4 * planes)
            inplanes = 4 * planes
    return shapes + _linear("fc", 1000, 2048)


def bert_base():
    hidden, ffn = 768, 3072
    shapes = [
        ("embeddings.word_embeddings.weight", (30522, hidden)),
        ("embeddings.position_embeddings.weight", (512, hidden)),
        ("embeddings.token_type_embeddings.weight", (2, hidden)),
    ]
    shapes += _norm("embeddings.LayerNorm", hidden)
    for layer in range(12):
        prefix = f"encoder.layer.{layer}"
        for part in ["query", "key", "value"]:
            shapes += _linear(f"{prefix}.attention.self.{part}", hidden, hidden)
        shapes += _linear(f"{prefix}.attention.output.dense", hidden, hidden)
        shapes += _norm(f"{prefix}.attention.output.LayerNorm", hidden)
        shapes += _linear(f"{prefix}.intermediate.dense", ffn, hidden)
        shapes += _linear(f"{prefix}.output.dense", hidden, ffn)
        shapes += _norm(f"{prefix}.output.LayerNorm", hidden)
    return shapes + _linear("pooler.dense", hidden, hidden)


def transformer_xl():
    d_model, d_inner, heads, head_dim = 410, 2100, 10, 41
    vocabulary, cutoffs = 267735, [20000, 40000, 200000]
    edges = [0] + cutoffs + [vocabulary]
    clusters = list(zip(edges[:-1], edges[1:]))
    shapes = [(f"word_emb.emb_layers.{i}.weight", (end - start, d_model)) for i, (start, end) in enumerate(clusters)]
    for layer in range(16):
        prefix = f"layers.{layer}"
        shapes += [
            (f"{prefix}.dec_attn.qkv_net.weight", (3 * heads * head_dim, d_model)),
            (f"{prefix}.dec_attn.o_net.weight", (d_model, heads * head_dim)),
            (f"{prefix}.dec_attn.r_net.weight", (heads * head_dim, d_model)),
            (f"{prefix}.dec_attn.r_w_bias", (heads, head_dim)),
            (f"{prefix}.dec_attn.r_r_bias", (heads, head_dim)),
        ]
        shapes += _norm(f"{prefix}.dec_attn.layer_norm", d_model)
        shapes += _linear(f"{prefix}.pos_ff.CoreNet.0", d_inner, d_model)
        shapes += _linear(f"{prefix}.pos_ff.CoreNet.3", d_model, d_inner)
        shapes += _norm(f"{prefix}.pos_ff.layer_norm", d_model)
    shapes += [("crit.cluster_weight", (len(cutoffs), d_model)), ("crit.cluster_bias", (len(cutoffs),))]
    return shapes + [(f"crit.out_layers.{i}.bias", (end - start,)) for i, (start, end) in enumerate(clusters)]


def tiny():
    return [("conv.weight", (32, 16, 3, 3)), ("fc.weight", (64, 256)), ("fc.bias", (64,)), ("emb.weight", (300, 64))]


SHAPE_SETS = {"resnet50": resnet50, "bert-base": bert_base, "transformer-xl": transformer_xl, "tiny": tiny}
# One line each for reports.
DESCRIPTIONS = {
    "resnet50": "torchvision's ResNet-50",
    "bert-base": "Hugging Face BertModel, bert-base-uncased, separate q/k/v, with pooler",
    "transformer-xl": "Transformer-XL WikiText-103 base: 16 layers, d_model 410, 10 heads, "
    "d_inner 2100, adaptive embedding of 267,735 tokens (cutoffs 20k/40k/200k, "
    "div_val 1), softmax tied to it",
    "tiny": "four small tensors (smoke test)",
}


def shape_set(name):
    """[(parameter name, shape)] of the named set; KeyError lists the known names."""
    if name not in SHAPE_SETS:
        raise KeyError(f"unknown shape set {name!r}; known: {', '.join(SHAPE_SETS)}")
    return SHAPE_SETS[name]()


def parameter_count(shapes):
    return sum(math.prod(shape) for _, shape in shapes)


def _linear(prefix, out_features, in_features):
    return [(f"{prefix}.weight", (out_features, in_features)), (f"{prefix}.bias", (out_features,))]


def _norm(prefix, features):
    return [(f"{prefix}.weight", (features,)), (f"{prefix}.bias", (features,))]
