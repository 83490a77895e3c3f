"""DeepSpeed's checkpoint layout: read as a zeroengine manifest (reader), written for DeepSpeed (to_deepspeed)."""
