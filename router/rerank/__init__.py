"""POST /rerank (and /reranking, /v1/rerank, /v1/reranking): documents
ordered by how relevant a causal LM judges each to a query, in llama.cpp's
and Jina's/Cohere's shape. Served only by models started with --reranking."""
