"""Tokenizer, corpus and datasets.

``tokenizer``: the BPE tokenizer and the shipped assets (``SHIPPED_DIR``, ``build_assets``);
``dataset``: corpus file -> token stream -> windows -> per-rank streams;
``datamodule``: ``TextDataModule``, the LightningDataModule a run uses.
"""
