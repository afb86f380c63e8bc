"""What the policies share but is not a policy: attention scoring (`scoring.py`), sentence segmentation
(`sentences.py`) and SkipKV's steering vectors (`steering.py`). Nothing here registers a policy."""
