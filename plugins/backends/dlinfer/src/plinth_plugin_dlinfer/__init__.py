"""plinth backend plugin: the ops of DeepLink's dlinfer (``dlinfer.ops``)."""
