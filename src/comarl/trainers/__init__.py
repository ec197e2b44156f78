"""Trainers. The MAGRPO family shares one loop in ``magrpo.py``; critics are in ``actor_critic.py``, preference
methods (MADPO, MARLHF) in ``preference.py``."""

from comarl.trainers.magrpo import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer

__all__ = ["MAGRPOTrainer", "MAREINFORCETrainer", "MARLOOTrainer", "MAReMaxTrainer"]
