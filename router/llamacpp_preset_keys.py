"""The option names llama.cpp's server knows (tools/server/README.md, its
common, sampling and server parameters), as a preset writes them: without
dashes, long names and the short ones alike.

A preset brought over from llama-server carries keys that mean nothing to
Roundhouse (hf-repo, n-gpu-layers, flash-attn, spec-draft-hf, ...). Those are
accepted and named in one warning (router/presets.py); a key that is neither
ours nor llama.cpp's is still refused, since it is most likely a misspelling.
Keys llama.cpp spells differently from an option of ours (ctx-size, parallel,
...) are not in this set: the preset parser refuses them and names ours.
"""

from __future__ import annotations

_COMMON = """
threads-batch tb cpu-mask C cpu-range Cr cpu-strict prio poll cpu-mask-batch Cb cpu-range-batch
Crb cpu-strict-batch prio-batch poll-batch predict n-predict n ubatch-size ub keep swa-full
flash-attn fa perf no-perf escape no-escape e rope-scaling rope-scale rope-freq-base
rope-freq-scale yarn-orig-ctx yarn-ext-factor yarn-attn-factor yarn-beta-slow yarn-beta-fast
kv-offload kvo no-kv-offload nkvo repack no-repack nr no-host cache-type-k ctk cache-type-v ctv
defrag-thold dt rpc load-mode lm lazy-mode lzm numa dev list-devices override-tensor ot
n-cpu-ffn ncffn gpu-layers n-gpu-layers ngl split-mode sm
tensor-split ts main-gpu mg fit fit-target fitt fit-ctx fitc check-tensors override-kv op-offload
no-op-offload lora lora-scaled control-vector control-vector-scaled control-vector-layer-range
model-url mu docker-repo dr hf-repo hf hfr hf-file hff hf-token hft log-disable log-file
log-jsonl no-log-jsonl log-colors verbose log-verbose v offline verbosity log-verbosity lv
log-prefix no-log-prefix log-timestamps no-log-timestamps spec-draft-type-k cache-type-k-draft
ctkd spec-draft-type-v cache-type-v-draft ctvd mmap no-mmap mlock
"""

_SAMPLING = """
samplers sampler-seq sampling-seq ignore-eos top-nsigma top-n-sigma xtc-probability
xtc-threshold typical typical-p repeat-last-n repeat-penalty presence-penalty frequency-penalty
dry-multiplier dry-base dry-allowed-length dry-penalty-last-n dry-sequence-breaker
adaptive-target adaptive-decay dynatemp-range dynatemp-exp mirostat mirostat-lr mirostat-ent
logit-bias l grammar grammar-file json-schema j json-schema-file jf backend-sampling bs
"""

_SERVER = """
lookup-cache-static lcs lookup-cache-dynamic lcd kv-unified-per-slot ctx-checkpoints
swa-checkpoints ctxcp checkpoint-min-step cms kv-unified kvu no-kv-unified
no-kvu cache-idle-slots no-cache-idle-slots context-shift no-context-shift reverse-prompt r
special sp warmup no-warmup spm-infill cont-batching cb no-cont-batching nocb
mmproj-url mmu mmproj-auto no-mmproj no-mmproj-auto mmproj-offload no-mmproj-offload
mmproj-device mmdev image-min-tokens image-max-tokens mtmd-batch-max-tokens video-fps
video-timestamp-interval video-ffmpeg-dir a tags embd-normalize reuse-port path cors-origins
cors-methods cors-headers cors-credentials no-cors-credentials api-prefix ui-config
webui-config ui-config-file webui-config-file ui-mcp-proxy webui-mcp-proxy no-ui-mcp-proxy
no-webui-mcp-proxy tools tools-runtime mcp-servers-config mcp-servers-json agent ag no-agent
no-ag ui webui no-ui no-webui embedding embeddings ssl-key-file ssl-cert-file
timeout to sse-ping-interval threads-http cache-prompt no-cache-prompt cache-reuse metrics
props slots no-slots slot-save-path media-path jinja no-jinja reasoning-format reasoning rea
reasoning-effort reasoning-budget-message reasoning-preserve
no-reasoning-preserve skip-chat-parsing no-skip-chat-parsing prefill-assistant
no-prefill-assistant slot-prompt-similarity sps lora-init-without-apply log-prompts-dir
dedup-cache-models
"""

_SPECULATIVE = """
spec-draft-hf hfd hfrd hf-repo-draft spec-draft-threads td threads-draft
spec-draft-threads-batch tbd threads-batch-draft spec-draft-cpu-mask Cd cpu-mask-draft
spec-draft-cpu-range Crd cpu-range-draft spec-draft-cpu-strict cpu-strict-draft
spec-draft-prio prio-draft spec-draft-poll poll-draft spec-draft-cpu-mask-batch Cbd
cpu-mask-batch-draft spec-draft-cpu-strict-batch cpu-strict-batch-draft spec-draft-prio-batch
prio-batch-draft spec-draft-poll-batch poll-batch-draft spec-draft-override-tensor otd
override-tensor-draft spec-draft-cpu-moe cmoed cpu-moe-draft spec-draft-n-cpu-moe
spec-draft-ncmoe ncmoed n-cpu-moe-draft spec-draft-n-min spec-synth-len
spec-synth-rates spec-draft-p-split draft-p-split spec-draft-p-min draft-p-min
spec-draft-backend-sampling no-spec-draft-backend-sampling spec-draft-sampling
spec-draft-device devd device-draft spec-draft-ngl ngld gpu-layers-draft n-gpu-layers-draft
spec-type spec-ngram-mod-n-min spec-ngram-mod-n-max
spec-ngram-mod-n-match spec-ngram-simple-size-n spec-ngram-simple-size-m
spec-ngram-simple-min-hits spec-ngram-map-k-size-n spec-ngram-map-k-size-m
spec-ngram-map-k-min-hits spec-ngram-map-k4v-size-n spec-ngram-map-k4v-size-m
spec-ngram-map-k4v-min-hits draft-min draft-n-min spec-ngram-size-n
spec-ngram-size-m spec-ngram-min-hits spec-default
"""

# llama.cpp options Roundhouse has no use for: a preset may carry them.
UNUSED_LLAMA_CPP_KEYS = frozenset((_COMMON + _SAMPLING + _SERVER + _SPECULATIVE).split())
