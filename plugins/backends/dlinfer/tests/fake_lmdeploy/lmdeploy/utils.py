"""lmdeploy/utils.py: get_logger."""
import logging


def get_logger(name):
    return logging.getLogger(name)
