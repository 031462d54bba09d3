"""pith apps"""
