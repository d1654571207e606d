"""kvferry.cluster"""
