"""Packaging for minisgl: metadata comes from nbdev's settings.ini, the native kernels from csrc/.

Build (torch must already be installed, hence no build isolation):
    pip install --no-build-isolation -e .
"""
import os
import shlex
from configparser import ConfigParser
from glob import glob
from pathlib import Path

import setuptools

here = Path(__file__).parent
config = ConfigParser(delimiters=["="])
config.read(here / "settings.ini", encoding="utf-8")
cfg = config["DEFAULT"]

for key in "version description keywords author author_email license lib_name user min_python".split():
    assert key in cfg, f"settings.ini is missing the key {key!r}"

licenses = {"apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License")}
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable"]
py_versions = "3.10 3.11 3.12 3.13".split()
min_python = cfg["min_python"]
lic = licenses.get(cfg["license"].lower(), (cfg["license"], None))
requirements = shlex.split(cfg.get("requirements", ""))
dev_requirements = shlex.split(cfg.get("dev_requirements", ""))


def ext_modules():
    """One extension, `minisgl._C`: the C++ CPU kernels always, the CUDA kernels where torch has CUDA.

    Set MINISGL_NO_EXT=1 to install without compiling (the pure-torch reference backend still works)."""
    if os.environ.get("MINISGL_NO_EXT") == "1":
        return [], {}
    from torch.utils import cpp_extension as ce

    sources = sorted(glob("csrc/*.cpp") + glob("csrc/cpu/*.cpp"))
    if not sources:
        return [], {}
    # -g0: Python's own CFLAGS ask for debug info, which for torch's headers is most of the compile time
    # (measured: 62 -> 38 s of CPU for bindings.cpp, 34 -> 13 s for gemm_bf16.cpp) and is never used
    # -fno-trapping-math (as torch builds): without it GCC will not if-convert float selects, and loops such as
    # the SiLU row stayed scalar in their AVX2 variant (the AVX-512 one vectorises through masks either way)
    cxx = ["-O3", "-g0", "-std=c++17", "-fopenmp", "-fno-trapping-math"]
    with_cuda = ce.CUDA_HOME is not None and __import__("torch").version.cuda is not None
    if with_cuda and os.environ.get("MINISGL_NO_CUDA") != "1":
        ext = ce.CUDAExtension(
            "minisgl._C",
            sources + sorted(glob("csrc/cuda/*.cu")),
            define_macros=[("MINISGL_WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--use_fast_math"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = ce.CppExtension("minisgl._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": ce.BuildExtension.with_options(use_ninja=True)}


exts, cmdclass = ext_modules()

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=(here / "README.md").read_text(encoding="utf-8") if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    keywords=cfg["keywords"],
    author=cfg["author"],
    author_email=cfg["author_email"],
    license=lic[0],
    url=cfg["git_url"],
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"])],
        "Intended Audience :: " + cfg["audience"].title(),
        "Natural Language :: " + cfg["language"].title(),
    ]
    + ([f"License :: {lic[1]}"] if lic[1] else [])
    + [f"Programming Language :: Python :: {v}" for v in py_versions[py_versions.index(min_python):]],
    packages=setuptools.find_packages(include=["minisgl", "minisgl.*"]),
    include_package_data=True,
    install_requires=requirements,
    extras_require={"dev": dev_requirements},
    python_requires=">=" + min_python,
    zip_safe=False,
    entry_points={
        "console_scripts": cfg.get("console_scripts", "").split(),
        "nbdev": [f"{cfg['lib_name']}={cfg['lib_name']}._modidx:d"],
    },
    ext_modules=exts,
    cmdclass=cmdclass,
)
