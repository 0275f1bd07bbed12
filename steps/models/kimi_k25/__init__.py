"""Kimi-K2.5 (KimiK25ForConditionalGeneration, model_type "kimi_k25"): a vision-language checkpoint whose language
model is Kimi-K2's, DeepSeek-V3's architecture (steps/models/deepseek_v3/, which this family extends for its config
fields, model and tensor names), and whose MoonViT vision tower and projector moerl carries through unchanged
(steps/models/carried.py; their tensors: vision.py) while RL trains the language model on text.

config.py (text_config and vision_config, what is refused: the INT4 release's compressed-tensors experts),
vision.py (the tower's and projector's tensors, as released), model.py, state_dict_adapter.py (the release's
names: language_model.model.*, language_model.lm_head, vision_tower.*, mm_projector.*), layout.py (transformers
5.23's save_pretrained layout renamed to the release's on import) and spec.py.
"""
