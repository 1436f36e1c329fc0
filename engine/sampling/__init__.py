"""From a batch's logits to one token per row.

`sampler` applies grammar masks, logit biases and penalties, then takes the
argmax or draws under temperature, top-k, top-p and min-p (one CUDA kernel on
a GPU); `grammar` keeps one xgrammar matcher per constrained request,
`grammar_compiler` compiles and caches their grammars, and `token_mask`
applies a step's bitmasks to the logits rows they belong to.
"""
