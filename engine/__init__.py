"""kvferry.engine"""
