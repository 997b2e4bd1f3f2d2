"""After an upgrade: the study's exported configuration and its baseline re-measured with
whatever vLLM, model and hardware are installed now, against what the study recorded.

- :mod:`.compare` (pure): each figure recorded vs now, the noise band, the verdict;
- :mod:`.workflow`: the study folder's check into ``regress.json``;
- :mod:`.command`: the ``regress`` command and its tables.
"""
