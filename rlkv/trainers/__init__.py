"""The RLKV gate trainer on TRL: config, trainer, rewards, checkpoint/export callbacks."""

from rlkv.trainers.checkpoints import head_mask_from_checkpoint, load_gate_checkpoint
from rlkv.trainers.config import GateGRPOConfig
from rlkv.trainers.gate_trainer import l1_penalty, penalty_weight
from rlkv.trainers.grpo import GateGRPOTrainer
from rlkv.trainers.rewards import boxed_math_reward, get_reward, reward_from_verifier, verifier_reward

__all__ = [
    "GateGRPOConfig",
    "GateGRPOTrainer",
    "boxed_math_reward",
    "get_reward",
    "head_mask_from_checkpoint",
    "l1_penalty",
    "load_gate_checkpoint",
    "penalty_weight",
    "reward_from_verifier",
    "verifier_reward",
]
