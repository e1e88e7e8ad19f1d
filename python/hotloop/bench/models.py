"""Gradient sets shaped like real models, for the benchmarks: parameter shapes of GPT-like transformers."""


def transformer_shapes(hidden, layers, vocab=50304):
    """Parameter shapes of a GPT-like model: embedding, then per layer qkv, proj, two MLP matrices,
    their biases and two layer norms (12 tensors a layer, about 12·hidden² parameters)."""
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,),
                   (4 * hidden, hidden), (4 * hidden,), (hidden, 4 * hidden), (hidden,),
                   (hidden,), (hidden,), (hidden,), (hidden,)]
    return shapes


# (hidden, layers): ~353 M parameters in 289 tensors, ~1.3 B in 481
MODEL_353M = (1024, 24)
MODEL_1_3B = (1600, 40)
MODEL_TINY = (256, 4)
