"""kvcache: the paged KV-cache block manager (pure Python + numpy)."""
