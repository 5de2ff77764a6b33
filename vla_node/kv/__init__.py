"""Multimodal KV cache building blocks: partitions (float or INT8 KIVI), attention over partitions
(segmented with an exact log-sum-exp merge, or gathered), and the vision memory with its policies."""
