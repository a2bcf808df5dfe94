"""The dashboard's ES modules, shipped as package data of tb_numerics."""
