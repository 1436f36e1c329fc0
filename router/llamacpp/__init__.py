"""llama.cpp's native server API: POST /completion, /tokenize, /detokenize,
/apply-template and GET /props, with llama.cpp's field names and shapes
(tools/server/README.md of llama.cpp). routes.add_routes registers them."""
