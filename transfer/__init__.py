"""kvferry.transfer"""
