"""Inline-PTX snippets shared by the backends: lean P's fold, the exp2 polynomial, fences, rescale."""
