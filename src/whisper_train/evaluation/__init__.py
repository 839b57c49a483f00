"""Judging a model as its user will: generate-based WER on each set, in its language.

evaluate   generation, scoring and the evaluate command's library, during training too
report     the written report of an evaluation (tables, worst utterances)
"""
