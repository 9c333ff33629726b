"""The knowledge lab: small STEM and dense models trained from scratch on a synthetic world of facts, so that recall,
capacity, editing by rows and the angular spread of tables are measured on models that know something.

`corpus` makes the world and its tokenizer, `train` the models, `measure` the measures, `run` puts them together,
`plots` draws them, `cli` is `stem-hf lab` (the full run: `benchmarks/knowledge_lab.py`). See docs/knowledge_lab.md.
The package imports nothing itself, so that parsing `stem-hf`'s arguments stays light: import the modules.
"""
