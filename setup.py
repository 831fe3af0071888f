"""Package layout for setuptools (the rest of the metadata lives in pyproject.toml).

The wheel carries the bundled default model as the data package `lucebox/bundled_models`, mapped
from the repository's models/ so that the checkout keeps a single copy at its root; pyproject.toml
cannot add a mapped package next to an automatic package search, hence this file.
Only the pair the default path loads goes in (models/default, models/default-dflash); the Q8_0
GGUF export beside them stays out of the wheel (17 MB that nothing loads by default).
"""
from setuptools import find_packages, setup

BUNDLED_MODELS = "lucebox.bundled_models"  # lucebox/default_model.py looks here first

setup(
    packages=find_packages(include=["lucebox", "lucebox.*"]) + [BUNDLED_MODELS],
    package_dir={BUNDLED_MODELS: "models"},
    package_data={
        BUNDLED_MODELS: ["default/**/*", "default-dflash/**/*"],
        "lucebox.server": ["static/**/*"],  # the dashboard's files
    },
    include_package_data=False,
)
