"""Trainers. The MAGRPO family shares one loop in ``magrpo.py``."""

from comarl.trainers.magrpo import MAGRPOTrainer, MAREINFORCETrainer, MAReMaxTrainer, MARLOOTrainer

__all__ = ["MAGRPOTrainer", "MAREINFORCETrainer", "MARLOOTrainer", "MAReMaxTrainer"]
